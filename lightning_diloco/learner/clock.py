"""An island's time, as one object it is given: what it reads, waits on and repeats.

:data:`SYSTEM_CLOCK` is the machine's; the simulation (lightning_diloco/simulate) gives an island
a virtual one, whose waits run its event queue instead of sleeping, so the island's own code runs
unchanged on the simulated clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

RECHECK_S = 1.0
"""Longest a wait goes without looking at its condition again. A stop asked for by a signal
handler (learner/inbox.py) runs on the waiting thread itself, between two of its steps: its
wake-up can come just before the wait begins, and is then missed."""


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a clock that never goes back (durations and timeouts)."""

    def time(self) -> float:
        """Seconds since the epoch: what increases across a process's restarts (sequence numbers)."""

    def wait(self, cond: threading.Condition, ready: Callable[[], bool], timeout: float) -> bool:
        """Until ``ready()`` (checked with ``cond`` held; whoever changes what it reads notifies
        ``cond``) or ``timeout`` seconds have passed; returns ``ready()``."""

    def every(self, seconds: float, action: Callable[[], None], *, until: threading.Event,
              name: str) -> Callable[[float], None]:
        """Run ``action()`` every ``seconds`` (the first after ``seconds``) until ``until`` is set;
        returns ``join(timeout)``, which waits at most ``timeout`` seconds for a run in progress to
        end. ``name``: the thread's, where it runs on one."""


class SystemClock:
    """The machine's clock; repeated actions run on a daemon thread each."""

    def now(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def wait(self, cond: threading.Condition, ready: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with cond:
            while not (done := ready()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                cond.wait(min(left, RECHECK_S))
            return done

    def every(self, seconds: float, action: Callable[[], None], *, until: threading.Event,
              name: str) -> Callable[[float], None]:
        def run() -> None:
            while not until.wait(seconds):
                action()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread.join


SYSTEM_CLOCK = SystemClock()
