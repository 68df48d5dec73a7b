"""One closer thread per fragment: it closes the fragment's round when the quorum and grace
rules say so (rounds.py decides), whether or not any caller is waiting, with the fragment's own
:meth:`~lightning_diloco.synchronizer.fragment.Fragment.close` (the outer step, then what the
close changes beyond the fragment: a failure there is logged and never retried, since the round is
closed and stepped and a closer that looked again would find nothing to close). Tests call
:meth:`Closers.poll` with a fake clock instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from lightning_diloco.core.threads import single_threaded_torch
from lightning_diloco.synchronizer.fragment import Fragment
from lightning_diloco.synchronizer.membership import Membership
from lightning_diloco.synchronizer.rounds import ClosedRound

log = logging.getLogger(__name__)

CLOSER_TICK = 0.25  # seconds between a closer's looks at liveness while a round waits out its grace window
IDLE_WAIT = 5.0
"""Seconds a closer sleeps while its round is not open or short of its quorum: only a push (or an
island leaving the run) can change that, and each notifies the fragment's condition, so this is a
safety net, not a tick.
(A 0.25 s tick there woke 24 threads 4 times a second beside an embedded synchronizer's training
loop for nothing: benchmarks/RESULTS.md, step-time overhead.)"""


def retry_wait(failures: int) -> float:
    """Seconds before a closer looks again after ``failures`` failed looks in a row (0: the first):
    backing off from CLOSER_TICK to IDLE_WAIT, an error that persists is logged every 5 s, not 4
    times a second."""
    return min(IDLE_WAIT, CLOSER_TICK * 2 ** min(failures, 8))


class Closers:
    def __init__(self, fragments: Mapping[int, Fragment], membership: Membership, *, clock: Callable[[], float],
                 closing: threading.Event, quorum: Callable[[], int]) -> None:
        """``fragments``: the owned fragments (they appear on the first join); ``membership``: who
        is live and how fast; ``quorum()``: the contributors a round needs now (fewer than K once
        islands left the run)."""
        self.fragments, self.membership, self.clock, self.closing = fragments, membership, clock, closing
        self.quorum = quorum
        self.threads: list[threading.Thread] = []
        self.sync_time = 0.0
        """Smoothed seconds a close takes: the grace window leaves room for it."""

    def start(self) -> None:
        """A thread for every owned fragment that has none yet."""
        running = {t.name for t in self.threads}
        for p in self.fragments:
            name = f"diloco-closer-{p}"
            if name not in running:
                thread = threading.Thread(target=self._loop, args=(p,), name=name, daemon=True)
                thread.start()
                self.threads.append(thread)

    def stop(self) -> None:
        """Call once ``closing`` is set and the rounds notified."""
        for thread in self.threads:
            thread.join(timeout=5)
        self.threads = []

    def _loop(self, fragment: int) -> None:
        single_threaded_torch()  # embedded in a training process: no OpenMP team of its own
        owned, failures = self.fragments[fragment], 0
        while not self.closing.is_set():
            with owned.cond:
                try:
                    wait = self._poll_fragment(owned, self.clock())
                    failures = 0
                except Exception:  # noqa: BLE001 - a closer that died would stop its fragment for good
                    wait = retry_wait(failures)
                    failures += 1
                    log.exception("fragment %d: closing its round failed (%d time(s) in a row); trying again in %.2f s",
                                  fragment, failures, wait)
                if failures:  # the whole back-off: every push notifies the condition (one failure logged a push)
                    deadline = time.monotonic() + wait
                    while not self.closing.is_set() and (left := deadline - time.monotonic()) > 0:
                        owned.cond.wait(left)
                elif wait > 0 and not self.closing.is_set():
                    owned.cond.wait(wait)

    def poll(self, now: float) -> list[ClosedRound]:
        """Close every round that is due to close at ``now``, on the caller's thread."""
        closed = []
        for fragment in self.fragments.values():
            with fragment.cond:
                before = fragment.rounds.last
                self._poll_fragment(fragment, now)
                last = fragment.rounds.last
                if last is not None and last is not before:
                    closed.append(last)
        return closed

    def _poll_fragment(self, fragment: Fragment, now: float) -> float:
        """Close the fragment's round if it is time; returns seconds to wait before looking again
        unless notified (0 when it just closed one). Called with the fragment's lock held."""
        live = self.membership.live(now)
        rounds = fragment.rounds
        decision = rounds.decide(fragment.state, now, live, self.membership.step_time(live), self.sync_time, self.quorum())
        if decision.close:
            started = time.perf_counter()
            fragment.close(now, decision.reason, taking_part=len(live | rounds.islands()))
            elapsed = time.perf_counter() - started
            self.sync_time = elapsed if not self.sync_time else 0.8 * self.sync_time + 0.2 * elapsed
            return 0.0
        if decision.deadline is None:  # not open, or short of quorum: waits for a push
            return IDLE_WAIT
        # in the grace window an island's death may close the round early: look at liveness often
        return min(max(0.0, decision.deadline - now), CLOSER_TICK)
