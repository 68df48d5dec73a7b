"""What an island's link needs of a way to reach the synchronizer's shards: one call per request,
records in and out, and the three ways a call can fail.

:class:`~lightning_diloco.transport.island_link.IslandLink` implements an island's link once
(sessions, rejoin, retries, subscriptions, close) over a :class:`ShardTransport`; there are two:
gRPC to remote shards (transport/grpc_shards.py) and direct calls to a synchronizer in this
process (synchronizer/local_link.py). Neither imports the other, and this module imports no gRPC.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lightning_diloco.core.protocol import Beat, Contribution, JoinInfo, PushAck, RoundRequest, SynchronizerStatus, VersionUpdate
from lightning_diloco.reasons import Reason

if TYPE_CHECKING:
    import torch

    from lightning_diloco.core.codecs import Payload
    from lightning_diloco.core.fragments import TensorSpec


class Refused(Exception):
    """The shard answered with a refusal. ``code``: the transport's status (gRPC's code; None in
    process), carried into the island's ``SynchronizerError``; ``label``: how the message names it."""

    def __init__(self, code: Any, reason: Reason, label: str, details: str) -> None:
        super().__init__(details)
        self.code, self.reason, self.label, self.details = code, reason, label, details


class Unanswered(Exception):
    """The shard did not answer (it is away, restarting or unreachable): a call is retried, a join
    goes on without the shard. ``code``: as :class:`Refused`'s."""

    def __init__(self, code: Any, label: str, details: str) -> None:
        super().__init__(details)
        self.code, self.label, self.details = code, label, details


@dataclass(frozen=True, kw_only=True)
class JoinRequest:
    """An island's join, repeated as it is at every rejoin."""

    island: int
    world_size: int
    specs: tuple[TensorSpec, ...]
    num_islands: int


@dataclass(frozen=True, kw_only=True)
class ShardJoin:
    """One shard's answer to a join."""

    info: JoinInfo
    shard: int
    num_shards: int


class EventStream(Protocol):
    """A subscription's events from one shard, until it ends or is cancelled (from any thread)."""

    def __iter__(self) -> Iterator[RoundRequest | VersionUpdate]: ...

    def cancel(self) -> Any: ...


class ShardTransport(Protocol):
    """Every call raises :class:`Refused`, :class:`Unanswered` or ``TimeoutError`` (a deadline
    passed); ``ValueError`` where it was closed under the call."""

    addresses: list[str]
    """Each shard's, in shard order, as messages name it."""
    description: str
    """What a closed link's calls say it was: "the client of the synchronizer at ..."."""

    def join(self, shard: int, request: JoinRequest, previous_session: str) -> ShardJoin: ...

    def seed(self, shard: int, island: int, fragment: int, payload: Payload, session: str) -> tuple[bool, int]: ...

    def push(self, shard: int, contribution: Contribution) -> PushAck: ...

    def pull(self, shard: int, island: int, fragment: int, session: str) -> tuple[int, torch.Tensor]: ...

    def heartbeat(self, shard: int, island: int, steps: int, step_time: float, schedule_step: int,
                  session: str) -> Beat: ...

    def leave(self, shard: int, island: int, session: str) -> None: ...

    def status(self, shard: int) -> SynchronizerStatus: ...

    def events(self, shard: int, island: int, versions: dict[int, int], session: str) -> EventStream: ...

    def wait_ready(self, shard: int | None, delay: float, closed: threading.Event) -> None:
        """Wait ``delay`` seconds, or less once the shard (every shard: None) can be reached."""

    def hint(self, shard: int, details: str) -> str:
        """What to add to a give-up's message (a TLS mismatch), or ""."""

    def close(self) -> None:
        """End every call in flight (they fail, or raise ValueError) and release the transport."""
