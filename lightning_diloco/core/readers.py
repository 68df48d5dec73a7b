"""Reader threads that hand a subscription's events to an island's callbacks, and their close.

An island's link reads its events on threads of their own and calls its callbacks there
(transport/subscription.py, over gRPC or in process). What a close promises, from whichever caller and however
many at once:

- once it has begun, a reader that gets an event hands it to nobody (one that was handing an
  event over as the close began may still call its callback: the close waits for it as for any);
- when it returns, no reader runs, except one still inside a callback after ``JOIN_TIMEOUT``
  seconds. The close does not wait for that one for ever (a callback that waits on the thread
  that closes would never return): it returns and logs a warning naming the reader and the
  callback that holds it. That reader ends as soon as its callback returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 5.0
"""Seconds a close waits, for all the readers together, before it reports those still running."""


class Readers:
    """The reader threads of one subscription, told to stop and joined together."""

    def __init__(self, what: str) -> None:
        """``what``: the subscription, as the warning about a reader still running names it."""
        self.what = what
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._inside: dict[int, Callable] = {}  # reader thread's ident -> the callback it is in

    def add(self, name: str, target: Callable[..., None], *args) -> None:
        self._threads.append(threading.Thread(target=target, args=args, name=name, daemon=True))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def hand(self, callback: Callable[..., None], *args) -> bool:
        """Call ``callback(*args)`` on this reader thread, unless the readers are stopping: then
        call nothing and return False (the reader ends)."""
        if self.stopping.is_set():
            return False
        me = threading.get_ident()
        self._inside[me] = callback
        try:
            callback(*args)
        finally:
            del self._inside[me]
        return True

    def join(self) -> list[str]:
        """Wait up to ``JOIN_TIMEOUT`` seconds, in all, for the readers to end (the calling one
        excepted: a callback may close its own link). Returns the names of those still running,
        each also logged as a warning naming the callback it is in."""
        deadline = time.monotonic() + JOIN_TIMEOUT
        for thread in self._threads:
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        running = [t for t in self._threads if t.is_alive() and t is not threading.current_thread()]
        for thread in running:
            assert thread.ident is not None  # it is alive, so it was started and has one
            callback = self._inside.get(thread.ident)
            inside = f"inside its callback {_name(callback)}" if callback is not None else "not inside a callback"
            log.warning("%s: closed, but its reader %s is still running %g s later, %s; it ends once that returns "
                        "and hands no further event", self.what, thread.name, JOIN_TIMEOUT, inside)
        return [t.name for t in running]


def _name(callback: Callable) -> str:
    return getattr(callback, "__qualname__", None) or repr(callback)
