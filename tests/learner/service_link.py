"""The client's interface over an in-process Synchronizer (no sockets), with fault switches."""

from __future__ import annotations

import threading

import dataclasses

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import RoundRequest
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.requests import Contribution, Refusal
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.transport.client import SynchronizerError


class ServiceLink:
    def __init__(self, service: Synchronizer) -> None:
        self.service = service
        self.down = False
        self.gate: threading.Event | None = None  # when set, pushes wait for it
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _check(self):
        if self.down:
            raise SynchronizerError(None, Reason.UNREACHABLE, "synchronizer is down (test)")

    def heartbeat(self, island, steps, step_time, schedule_step=0):
        self._check()
        return self.service.heartbeat(island, steps, step_time, schedule_step)

    def seed(self, island, p, value):
        return self.service.seed(island, p, get_codec("fp32").encode(value)), 0

    def pull(self, p):
        self._check()
        return self.service.pull(p)

    def push(self, **fields):
        if self.gate is not None:
            self.gate.wait(10)
        self._check()
        try:
            return self.service.push(Contribution(**fields))
        except Refusal as refusal:
            raise SynchronizerError(None, refusal.reason, str(refusal)) from None

    def subscribe(self, island, versions, *, on_request, on_version, on_reconnect=lambda: None):
        def read():
            for event in self.service.subscribe(island, versions(), active=lambda: not self._stop.is_set(), tick=0.05):
                if isinstance(event, RoundRequest):
                    on_request(event)
                else:  # the bytes a client reads off the wire
                    on_version(dataclasses.replace(event, payload=bytearray(event.payload.numpy().tobytes())))

        thread = threading.Thread(target=read, name=f"diloco-test-subscription-{island}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def close(self):
        self._stop.set()
        if self.gate is not None:
            self.gate.set()
        for thread in self._threads:
            thread.join(timeout=5)
