"""Deadlines for the streams that carry a fragment's payload, in either direction.

gRPC's synchronous server reads a client stream by blocking on its next message, so a client that
sends a valid header and then one byte every few seconds holds a worker (and one of its island's
stream slots) for as long as it likes. Every payload read (a seed's, a push's) is therefore
watched: one thread cancels the streams that have not delivered their payload within a grace
period plus the time the declared size takes at a minimum rate (pushes with a valid session had
no read deadline, only a cap of P + 2 streams per island).

The other direction has the same rule: gRPC takes a Pull's reply into its own buffers at once,
so a client that never reads it kept a copy of the fragment in the synchronizer for as long as
its call lasted (300 unread pulls of a 4 MB fragment held 1.0-1.2 GB). A Pull is cancelled
unless its client has read the whole reply within the same time.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import grpc

PAYLOAD_GRACE_S = 30.0  # seconds any payload may take, whatever its size (a connection that stalls briefly)
MIN_PAYLOAD_BYTES_PER_S = 256 * 1024  # 2 Mbit/s: an island on a slower link should use a smaller fragment


def payload_deadline(payload_bytes: int) -> float:
    """Seconds a client may take to send (or to read) a payload of ``payload_bytes``."""
    return PAYLOAD_GRACE_S + payload_bytes / MIN_PAYLOAD_BYTES_PER_S


class StreamDeadlines:
    """One watchdog thread for every payload in flight; it cancels a stream whose time is up,
    which ends the handler's blocking read with an error and frees the worker (or drops the
    reply gRPC was holding for a client that does not read it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[int, tuple[float, grpc.ServicerContext]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.cancelled = 0  # streams cancelled for being too slow (for tests and benchmarks)

    def watch(self, context: grpc.ServicerContext, seconds: float) -> Callable[[], None]:
        """Cancel the stream of ``context`` unless the returned function is called within ``seconds``."""
        key = next(self._ids)
        with self._cond:
            if self._closed:
                return lambda: None
            self._due[key] = (time.monotonic() + seconds, context)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="diloco-stream-deadlines", daemon=True)
                self._thread.start()
            self._cond.notify()

        def done() -> None:
            with self._cond:
                self._due.pop(key, None)

        return done

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now = time.monotonic()
                for key in [k for k, (at, _) in self._due.items() if at <= now]:
                    _, context = self._due.pop(key)
                    self.cancelled += 1
                    context.cancel()
                nearest = min((at for at, _ in self._due.values()), default=None)
                self._cond.wait(None if nearest is None else max(0.0, nearest - now))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)
