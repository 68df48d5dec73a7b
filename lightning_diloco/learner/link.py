"""What an island needs from its synchronizer, as a protocol.

One implementation, :class:`~lightning_diloco.transport.island_link.IslandLink`, over two
transports: :class:`~lightning_diloco.transport.client.SynchronizerClient` over gRPC (a remote
synchronizer), :class:`~lightning_diloco.synchronizer.local_link.LocalLink` by direct calls (an
embedded one; the island tests drive it with fault switches). One conformance test
(tests/learner/test_link_conformance.py) runs the same exchange against each, so an island cannot
tell them apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # the learner never imports gRPC itself
    import torch

    from lightning_diloco.core.protocol import Beat, Contribution, PushAck, RoundRequest, VersionUpdate


@runtime_checkable
class SynchronizerLink(Protocol):
    def heartbeat(self, island: int, steps: int, step_time: float, schedule_step: int = 0) -> Beat:
        """Report progress; returns every fragment's version and the run's step."""

    def seed(self, island: int, fragment: int, value: torch.Tensor) -> tuple[bool, int]:
        """Offer version 0 of a fragment; (whether this offer was the one taken, the version now)."""

    def pull(self, fragment: int) -> tuple[int, torch.Tensor]:
        """(version, fp32 value) of a fragment now."""

    def push(self, contribution: Contribution) -> PushAck:
        """Put a contribution into its round, with this link's session with the fragment's
        synchronizer (whatever ``contribution.session`` says); refusals raise
        ``SynchronizerError`` with a Reason."""

    def subscribe(self, island: int, versions: Callable[[], dict[int, int]], *,
                  on_request: Callable[[RoundRequest], None], on_version: Callable[[VersionUpdate], None],
                  on_reconnect: Callable[[], None] = ...) -> Any:
        """Start delivering round requests and new versions to the callbacks until :meth:`close`.
        The callbacks run on the link's reader threads; one may block, but a close waits for it
        only so long (core/readers.py)."""

    def leave(self, island: int) -> None:
        """Tell the synchronizer the island leaves the run (so no round waits for it); from then on
        the link does not join again by itself. Raises ``SynchronizerError`` when refused or not
        answered (the island logs it: the synchronizer may be gone)."""

    def close(self) -> None:
        """End the subscription and release what the link holds. Once it returns, from whichever
        caller (several at once included), no reader runs, but one held inside a callback past
        ``JOIN_TIMEOUT``: that one is logged, naming the callback, and hands no further event."""
