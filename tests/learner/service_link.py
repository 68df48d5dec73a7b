"""The production in-process link (synchronizer/local_link.py) with fault switches for tests."""

from __future__ import annotations

import threading

from lightning_diloco.reasons import Reason, SynchronizerError
from lightning_diloco.synchronizer.local_link import REOPEN_DELAY, LocalLink, LocalShards
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.transport.island_link import IslandLink
from lightning_diloco.transport.shard_transport import Unanswered


class ServiceLink(LocalLink):
    """``down``: every call fails as unreachable, as the gRPC client's do when the synchronizer
    is away (and the subscription's streams do not open). ``gate``: when set to an Event, pushes
    wait for it (the synchronizer holds them)."""

    def __init__(self, service: Synchronizer) -> None:
        IslandLink.__init__(self, _FaultyShards(self, service, tick=0.05), backoff=REOPEN_DELAY)
        self.service = service
        self.down = False
        self.gate: threading.Event | None = None

    def _call(self, what, call, *args, **kwargs):
        if self.down:
            raise SynchronizerError(None, Reason.UNREACHABLE, f"{what}: synchronizer is down (test)")
        return super()._call(what, call, *args, **kwargs)

    def close(self):
        if self.gate is not None:
            self.gate.set()
        super().close()


class _FaultyShards(LocalShards):
    def __init__(self, link: ServiceLink, service: Synchronizer, tick: float) -> None:
        super().__init__(service, tick)
        self.link = link

    def _away(self, what: str) -> None:
        if self.link.down:
            raise Unanswered(None, "UNAVAILABLE", f"{what}: synchronizer is down (test)")

    def push(self, shard, contribution):
        if self.link.gate is not None:
            self.link.gate.wait(10)
        return super().push(shard, contribution)

    def events(self, shard, island, versions, session):
        self._away("subscription")
        return super().events(shard, island, versions, session)

    def leave(self, shard, island, session):
        self._away("leave")
        super().leave(shard, island, session)
