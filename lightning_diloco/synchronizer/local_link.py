"""An island's link to a synchronizer in its own process: direct calls, no gRPC.

An island given no synchronizer address runs an embedded one (learner/island_membership.py). Over
loopback gRPC its own traffic cost the training process 3-4 ms of CPU per 170 ms step beside the
training loop, in gRPC's workers and threads and in serializing (benchmarks/RESULTS.md);
:class:`LocalLink` calls the :class:`~lightning_diloco.synchronizer.service.Synchronizer`
instead. It is the island's link of transport/island_link.py (sessions, rejoin, retries,
subscriptions, leave and close, the very code the gRPC client runs) over :class:`LocalShards`,
the in-process transport (tests/learner/test_link_conformance.py runs one exchange against both):

- the same checks: a payload reaches the service as the bytes the island encoded, and the service
  validates them as it does the server's (codec, size, layout hash, non-finite values);
- refusals surface as :class:`~lightning_diloco.reasons.SynchronizerError` with the service's
  reason; one that asks the island to join again is answered by joining again, as the client's;
- a join says the island's num_islands, as the client's does; it is trusted as the island's own
  (no ``island_running`` check: an embedded synchronizer serves its own process's island only);
- new versions and round requests arrive on a reader thread of its own, read off the service.

Payloads cross as uint8 tensors, uncopied: the service never writes into a payload, and decoding
one copies what is kept (core/codecs.py), so neither side sees the other's later writes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from lightning_diloco.core.codecs import Payload
from lightning_diloco.core.protocol import Beat, Contribution, PushAck, RoundRequest, SynchronizerStatus, VersionUpdate
from lightning_diloco.synchronizer.requests import Refusal
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.transport.island_link import IslandLink
from lightning_diloco.transport.shard_transport import JoinRequest, Refused, ShardJoin

T = TypeVar("T")

REOPEN_DELAY = 0.1  # seconds: the link's backoff, between a subscription's end and its reopening (never a busy loop)


class LocalShards:
    """The in-process transport (transport/shard_transport.py): one shard, the ``service``.
    ``tick``: seconds a subscription waits for news before looking again (a cancel wakes it)."""

    description = "the link to the embedded synchronizer"

    def __init__(self, service: Synchronizer, tick: float = 0.5) -> None:
        self.service, self.tick = service, tick
        self.addresses = ["the embedded synchronizer"]

    def join(self, shard: int, request: JoinRequest, previous_session: str) -> ShardJoin:
        # no previous session: trusted as this process's own island (no island_running check)
        info = refused_as_transport(lambda: self.service.join(request.island, request.world_size, list(request.specs),
                                                              num_islands=request.num_islands))
        return ShardJoin(info=info, shard=self.service.shard, num_shards=self.service.num_shards)

    def seed(self, shard: int, island: int, fragment: int, payload: Payload, session: str) -> tuple[bool, int]:
        def call() -> tuple[bool, int]:
            seeded = self.service.seed(island, fragment, payload, session=session)
            return seeded, self.service.versions()[fragment]

        return refused_as_transport(call)

    def push(self, shard: int, contribution: Contribution) -> PushAck:
        return refused_as_transport(lambda: self.service.push(contribution))

    def pull(self, shard: int, island: int, fragment: int, session: str) -> tuple[int, torch.Tensor]:
        """A copy, the island's to change; for the island's session, as the server's Pull."""
        def call() -> tuple[int, torch.Tensor]:
            self.service.admit_pull(island, fragment, session)
            return self.service.pull(fragment, island=island)

        return refused_as_transport(call)

    def heartbeat(self, shard: int, island: int, steps: int, step_time: float, schedule_step: int, session: str) -> Beat:
        return refused_as_transport(lambda: self.service.heartbeat(island, steps, step_time, schedule_step, session=session))

    def leave(self, shard: int, island: int, session: str) -> None:
        refused_as_transport(lambda: self.service.leave(island, session=session))

    def status(self, shard: int) -> SynchronizerStatus:
        return refused_as_transport(self.service.status)

    def events(self, shard: int, island: int, versions: dict[int, int], session: str) -> LocalEvents:
        return LocalEvents(self, island, versions, session)

    def wait_ready(self, shard: int | None, delay: float, closed: threading.Event) -> None:
        pass  # the service is always there: a call that asked to join again is made again at once

    def hint(self, shard: int, details: str) -> str:
        return ""

    def close(self) -> None:
        pass  # nothing held: the link's subscriptions end with their streams


class LocalEvents:
    """One island's events read off the service, until the service ends them or :meth:`cancel`."""

    def __init__(self, shards: LocalShards, island: int, versions: dict[int, int], session: str) -> None:
        self.service = shards.service
        self._cancelled = threading.Event()
        self._events = refused_as_transport(lambda: self.service.subscribe(
            island, versions, active=lambda: not self._cancelled.is_set(), tick=shards.tick, session=session))

    def cancel(self) -> None:
        self._cancelled.set()
        self.service.wake_subscriptions()  # where the stream waits for news

    def __iter__(self) -> Iterator[RoundRequest | VersionUpdate]:
        try:
            yield from self._events
        except Refusal as refusal:
            raise refused(refusal) from None


class LocalLink(IslandLink):
    """A :class:`~lightning_diloco.learner.link.SynchronizerLink` over a service in this process."""

    def __init__(self, service: Synchronizer) -> None:
        super().__init__(LocalShards(service), backoff=REOPEN_DELAY)
        self.service = service

    @property
    def session(self) -> str:
        """This island's session ("": not joined)."""
        return self.sessions[0]


def refused(refusal: Refusal) -> Refused:
    return Refused(None, refusal.reason, f"{refusal.reason}", str(refusal))


def refused_as_transport(call: Callable[[], T]) -> T:
    """``call()``, a refusal raised as the transport's."""
    try:
        return call()
    except Refusal as refusal:
        raise refused(refusal) from None
