"""The end of an island's run: wait for its last rounds, then end with the global model.

When training ends, the contributions still in flight may yet be merged: :meth:`EndOfRun.finish`
waits for their rounds a few step times (a late one, whose round opens only when some island sends
for it, is not waited for), then loads the current global model on every rank, if it holds some
of this island's work; otherwise the local weights stay, and a warning says why. The leader
decides (:meth:`EndOfRun._final_plan`) and broadcasts the decision, as at every step boundary.
Closed afterwards (the strategy's teardown), the island leaves the run (leader.py): no round of
the islands still training waits for it. A stop (SIGTERM) ends the wait for the last rounds at
once (:meth:`~lightning_diloco.learner.island.IslandLearner.stop`).

:class:`EndOfRun` is a part of :class:`~lightning_diloco.learner.island.IslandLearner`, which
mixes it in: it uses the island's fragments, inbox, link and counters, and its ``_share``,
``_share_fragment``, ``_settled`` and ``write_fragment``.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.fragments import FragmentLayout
from lightning_diloco.learner.flights import Flight
from lightning_diloco.learner.fragment_sync import FragmentSync
from lightning_diloco.learner.inbox import Inbox
from lightning_diloco.learner.link import SynchronizerLink

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FINAL_WAIT_STEPS = 4  # the end waits for its last rounds this many x (tau + 1) step times ...
FINAL_WAIT_MIN_S = 3.0  # ... and at least this long (a tiny model's steps take milliseconds)


class EndOfRun:
    """The end of an :class:`~lightning_diloco.learner.island.IslandLearner`'s run."""

    # the island's, set in its __init__ (``in_flight`` is its property)
    config: RunConfig
    layout: FragmentLayout
    island: int
    link: SynchronizerLink | None
    is_leader: bool
    fragments: list[FragmentSync]
    inbox: Inbox | None
    step: int
    schedule_step: int
    push_wait: float
    merged_any: bool
    counters: dict[str, int]
    _lock: threading.Lock
    _step_time: float

    if TYPE_CHECKING:  # the island's property and methods, for the type checker only
        @property
        def in_flight(self) -> dict[int, Flight]: ...
        def _share(self, obj: Any) -> Any: ...
        def _share_fragment(self, p: int, value: torch.Tensor | None) -> torch.Tensor: ...
        def _settled(self, p: int) -> bool: ...
        def write_fragment(self, p: int, flat: torch.Tensor) -> None: ...

    def finish(self, timeout: float | None = None) -> bool:
        """Wait for the rounds still in flight, then load the current global model on every rank.

        Waits at most ``timeout`` seconds (default :meth:`final_wait`: a few step times); a
        contribution whose round has not closed by then is counted as ``unmerged`` and said in the
        log. The global model replaces the local weights only if it holds this island's work (one
        of its contributions was merged); otherwise the local weights stay and a warning says why.
        Returns whether the global model was loaded.
        """
        plan = None
        if self.is_leader:
            plan = self._final_plan(self.final_wait() if timeout is None else timeout)
        for f in self.fragments:
            f.flight = None
        plan = self._share(plan)
        if plan is None:
            return False
        for p, version in plan.items():
            f = self.fragments[p]
            f.base, f.version = self._share_fragment(p, f.base if self.is_leader else None), version
            self.write_fragment(p, f.base)
        return True

    def final_wait(self) -> float:
        """Seconds the end waits for its last rounds: FINAL_WAIT_STEPS x (tau + 1) step times (a
        round closes within tau step times of its quorum), at least FINAL_WAIT_MIN_S, at most push_wait."""
        steps = FINAL_WAIT_STEPS * (self.config.schedule.overlap_steps + 1)
        return min(self.push_wait, max(FINAL_WAIT_MIN_S, steps * self._step_time))

    def _final_plan(self, timeout: float) -> dict | None:
        try:  # the final step count, so that the run's report gives the steps as trained
            self.link.heartbeat(self.island, self.step, self._step_time, self.schedule_step)
        except Exception as err:  # noqa: BLE001 - liveness only
            log.debug("island %d: final heartbeat failed: %s", self.island, err)
        # A late contribution waits for a round that opens only when some island sends for it; at
        # the end of a run nobody may, so it is not waited for: it stays queued and is merged if
        # the run goes on. Whether a send is late is known only from its ack, which may come
        # during the wait: the wait ends once every send is settled or known late.
        in_flight = self.in_flight
        self.inbox.wait(lambda: all(f.late() or self._settled(p) for p, f in in_flight.items()), timeout)
        late = sorted(p for p, f in in_flight.items() if f.late() and not self._settled(p))
        open_rounds = sorted(p for p, f in in_flight.items() if not f.late() and not self._settled(p))
        if late:
            log.info("island %d: late contribution(s) to fragment(s) %s wait for their next round: not merged by the end",
                     self.island, late)
        if open_rounds:
            log.warning("island %d: the round(s) of fragment(s) %s did not close within %.1f s of the end: those "
                        "contributions are not in the global model this island ends with", self.island, open_rounds, timeout)
        with self._lock:
            self.counters["unmerged"] += len(late) + len(open_rounds)
        self.merged_any = self.merged_any or any(a.included for a in self.inbox.take(lambda a: True))
        if not self.merged_any:
            log.warning("island %d: none of its contributions was merged into the global model before training ended "
                        "(a run shorter than the sync schedule?); keeping the local weights", self.island)
            return None
        plan, missed = {}, {}
        for p in range(self.layout.num_fragments):
            try:
                version, self.fragments[p].base = self.link.pull(p)
                plan[p] = version
            except Exception as err:  # keep the local values rather than crash at the very end
                missed[p] = err
        if missed:  # e.g. a dead shard: its fragments keep this island's own progress
            log.warning("island %d: could not pull fragment(s) %s of the final global model, keeping their local "
                        "weights: %s", self.island, sorted(missed), next(iter(missed.values())))
        return plan or None
