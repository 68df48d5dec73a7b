"""The simulation's virtual clock: an event queue run in one thread.

Events at the same time run in the order they were scheduled, so a run depends on nothing but its
inputs: no thread, no wall-clock reading decides what happens first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.after_each: Callable[[], None] = lambda: None
        """Run after every event (the synchronizer's rounds and deliveries look at the new state)."""

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` at virtual time ``when`` (not before now)."""
        heapq.heappush(self._queue, (max(when, self.now), next(self._order), action))

    def pending(self) -> bool:
        return bool(self._queue)

    def run_one(self) -> bool:
        """Run the next event; False when there is none."""
        if not self._queue:
            return False
        self.now, _, action = heapq.heappop(self._queue)
        action()
        self.after_each()
        return True

    def run_until(self, condition: Callable[[], bool], deadline: float) -> bool:
        """Run events until ``condition()`` holds or the next event lies past ``deadline`` (then the
        clock moves to ``deadline``); returns ``condition()``. An island that waits (synchronous
        DiLoCo, the end of its run) calls this from inside its own event: the others go on meanwhile."""
        while not condition():
            if not self._queue or self._queue[0][0] > deadline:
                self.now = max(self.now, deadline)
                return condition()
            self.run_one()
        return True

    def run(self) -> None:
        while self.run_one():
            pass
