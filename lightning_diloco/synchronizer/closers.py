"""One closer thread per fragment: it closes the fragment's round when the quorum and grace
rules say so (rounds.py decides), whether or not any caller is waiting, and steps the outer
optimizer through the round's close. Tests call :meth:`Closers.poll` with a fake clock instead.
"""

from __future__ import annotations

import logging
import threading
import time

from lightning_diloco.core.threads import single_threaded_torch
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.rounds import ClosedRound, FragmentRounds

log = logging.getLogger(__name__)

CLOSER_TICK = 0.25  # seconds between a closer's looks at liveness while a round waits


class Closers:
    def __init__(self, service) -> None:
        """``service``: the :class:`~lightning_diloco.synchronizer.service.Synchronizer` whose
        rounds are closed."""
        self.service = service
        self.threads: list[threading.Thread] = []
        self.sync_time = 0.0
        """Smoothed seconds a close takes: the grace window leaves room for it."""

    def start(self) -> None:
        """A thread for every owned fragment that has none yet (fragments appear on the first join)."""
        running = {t.name for t in self.threads}
        for p in self.service.rounds:
            name = f"diloco-closer-{p}"
            if name not in running:
                thread = threading.Thread(target=self._loop, args=(p,), name=name, daemon=True)
                thread.start()
                self.threads.append(thread)

    def stop(self) -> None:
        """Call once ``service.closing`` is set and the rounds notified."""
        for thread in self.threads:
            thread.join(timeout=5)
        self.threads = []

    def _loop(self, fragment: int) -> None:
        service = self.service
        single_threaded_torch()  # embedded in a training process: no OpenMP team of its own
        rounds = service.rounds[fragment]
        while not service.closing.is_set():
            with rounds.cond:
                wait = self._poll_fragment(rounds, service.clock())
                if wait > 0 and not service.closing.is_set():
                    rounds.cond.wait(min(wait, CLOSER_TICK))
            if wait == 0:
                service.checkpointer.due.set()  # written on its own thread: rounds never wait for the disk

    def poll(self, now: float) -> list[ClosedRound]:
        """Close every round that is due to close at ``now``, on the caller's thread."""
        service = self.service
        closed = []
        for rounds in service.rounds.values():
            with rounds.cond:
                before = rounds.last
                self._poll_fragment(rounds, now)
                if rounds.last is not before:
                    closed.append(rounds.last)
        if closed:  # outside the fragments' locks: a checkpoint takes each of them in turn
            service.checkpointer.write_if_due()
        return closed

    def _poll_fragment(self, rounds: FragmentRounds, now: float) -> float:
        """Close the fragment's round if it is time; returns seconds until the decision may change
        (0 when it just closed one). Called with the fragment's lock held."""
        service = self.service
        live = service.membership.live(now)
        decision = rounds.decide(now, live, service.membership.step_time(live), self.sync_time)
        if decision.close:
            self._close(rounds, decision.reason, now, live)
            return 0.0
        return CLOSER_TICK if decision.deadline is None else max(0.0, decision.deadline - now)

    def _close(self, rounds: FragmentRounds, reason: str, now: float, live: set[int]) -> None:
        service = self.service
        started = time.perf_counter()
        closed = rounds.close(now, reason)
        if closed.dropped:
            log.warning("fragment %d round %d: %d contribution(s) left out, the step with them was not finite",
                        closed.fragment, closed.round, closed.dropped)
        with service.lock:
            service.state.outer_steps += bool(closed.islands)
            service.accepted["merged"] += len(closed.islands)
            if closed.dropped:
                service.refused[Reason.NON_FINITE_STEP.value] += closed.dropped
            elapsed = time.perf_counter() - started
            self.sync_time = elapsed if not self.sync_time else 0.8 * self.sync_time + 0.2 * elapsed
        service.membership.credit(closed.islands, now)
        service.membership.withdraw(closed.fragment, closed.round)  # also wakes the subscriptions
        log.debug("fragment %d round %d -> version %d from islands %s (%s)", closed.fragment, closed.round,
                  closed.version, closed.islands, reason)
