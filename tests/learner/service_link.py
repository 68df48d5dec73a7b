"""The production in-process link (synchronizer/local_link.py) with fault switches for tests."""

from __future__ import annotations

import threading

from lightning_diloco.reasons import Reason, SynchronizerError
from lightning_diloco.synchronizer.local_link import LocalLink
from lightning_diloco.synchronizer.service import Synchronizer


class ServiceLink(LocalLink):
    """``down``: every call fails as unreachable, as the gRPC client's do when the synchronizer
    is away. ``gate``: when set to an Event, pushes wait for it (the synchronizer holds them)."""

    def __init__(self, service: Synchronizer) -> None:
        super().__init__(service, tick=0.05)
        self.down = False
        self.gate: threading.Event | None = None

    def _call(self, what, call):
        if self.down:
            raise SynchronizerError(None, Reason.UNREACHABLE, f"{what}: synchronizer is down (test)")
        return super()._call(what, call)

    def push(self, contribution):
        if self.gate is not None:
            self.gate.wait(10)
        return super().push(contribution)

    def close(self):
        if self.gate is not None:
            self.gate.set()
        super().close()
