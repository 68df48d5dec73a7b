"""A client closed while a call backs off from an absent synchronizer: gRPC prints nothing."""

from __future__ import annotations

import logging
import socket
import threading
import time

from lightning_diloco.reasons import SynchronizerError
from lightning_diloco.transport.client import SynchronizerClient
from tests.helpers import SPECS


def _absent_address() -> str:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


class _Waiting(logging.Handler):
    """Set once the client says it waits for an unreachable synchronizer (after its first retries)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def emit(self, record):
        if "no synchronizer reachable" in record.getMessage():
            self.waiting.set()


def test_a_close_while_a_call_backs_off_prints_no_traceback_from_a_grpc_thread(monkeypatch):
    """The wait between retries used grpc.channel_ready_future, whose connectivity is polled on a
    thread of gRPC's: a close while it still polled (up to 0.2 s after each wait) made it raise
    "Cannot invoke RPC: Channel closed!", printed as a traceback with no frame of ours, in about
    three closes of four."""
    raised: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(f"{args.thread.name}: {args.exc_value!r}"))
    before = set(threading.enumerate())
    logger = logging.getLogger("lightning_diloco.transport.island_link")
    for _ in range(8):
        client = SynchronizerClient(_absent_address(), max_retries=2, backoff=0.05, max_backoff=0.3)
        handler, outcome = _Waiting(), {}

        def join():
            try:
                client.join(0, 1, SPECS, patience=600.0)  # noqa: B023 - joined within this iteration
            except SynchronizerError as err:
                outcome["error"] = err  # noqa: B023 - joined within this iteration

        thread = threading.Thread(target=join, name="diloco-test-backing-off")
        logger.addHandler(handler)
        try:
            thread.start()
            assert handler.waiting.wait(60), "the join never backed off"
            client.close()  # lands while the join backs off between retries
            thread.join(timeout=60)
            assert not thread.is_alive() and "closed" in str(outcome["error"])
        finally:
            logger.removeHandler(handler)
            client.close()
            thread.join(timeout=60)
    deadline = time.monotonic() + 30  # whatever gRPC started ends (or raises) before we look
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert raised == []
