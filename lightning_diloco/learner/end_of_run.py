"""The end of an island's run: wait for its last rounds, then end with the global model.

When training ends, the contributions still in flight may yet be merged: the island's
:meth:`~lightning_diloco.learner.island.IslandLearner.finish` has its leader (:func:`end_of_run`)
wait for their rounds a few step times (:func:`final_wait`; a late one, whose round opens only
when some island sends for it, is not waited for) and pull the current global model, if it holds
some of this island's work; otherwise the local weights stay, and a warning says why. The leader
decides and broadcasts the decision, as at every step boundary, and every rank loads it. Closed
afterwards (the strategy's teardown), the island leaves the run (leader.py): no round of the
islands still training waits for it. A stop (SIGTERM) ends the wait for the last rounds at once
(:meth:`~lightning_diloco.learner.island.IslandLearner.stop`).
"""

from __future__ import annotations

import logging

from lightning_diloco.learner.fragment import IslandFragment
from lightning_diloco.learner.inbox import Inbox
from lightning_diloco.learner.link import SynchronizerLink

log = logging.getLogger(__name__)

FINAL_WAIT_STEPS = 4  # the end waits for its last rounds this many x (tau + 1) step times ...
FINAL_WAIT_MIN_S = 3.0  # ... and at least this long (a tiny model's steps take milliseconds)


def final_wait(overlap_steps: int, step_time: float, push_wait: float) -> float:
    """Seconds the end waits for its last rounds: FINAL_WAIT_STEPS x (tau + 1) step times (a
    round closes within tau step times of its quorum), at least FINAL_WAIT_MIN_S, at most push_wait."""
    return min(push_wait, max(FINAL_WAIT_MIN_S, FINAL_WAIT_STEPS * (overlap_steps + 1) * step_time))


def end_of_run(link: SynchronizerLink, island: int, *, fragments: list[IslandFragment], inbox: Inbox,
               progress: tuple[int, float, int], timeout: float, merged_any: bool) -> tuple[dict[int, int] | None, bool, int]:
    """The leader's part of the end: the last heartbeat (``progress``: steps, step time, schedule
    step), a wait of at most ``timeout`` seconds for the rounds of the sends in flight, the pull
    of the global model into each fragment's ``base``. Returns (fragment -> version pulled, None to
    keep the local weights; whether a contribution of this island is in the global model,
    ``merged_any`` before; how many sends were not merged by the end)."""
    try:  # the final step count, so that the run's report gives the steps as trained
        link.heartbeat(island, *progress)
    except Exception as err:  # noqa: BLE001 - liveness only
        log.debug("island %d: final heartbeat failed: %s", island, err)
    # A late contribution waits for a round that opens only when some island sends for it; at
    # the end of a run nobody may, so it is not waited for: it stays queued and is merged if
    # the run goes on. Whether a send is late is known only from its ack, which may come
    # during the wait: the wait ends once every send is settled or known late.
    inbox.wait(lambda: not any(f.awaited(inbox) for f in fragments), timeout)
    late = [f.number for f in fragments if f.late() and not f.settled(inbox)]
    open_rounds = [f.number for f in fragments if f.awaited(inbox)]
    if late:
        log.info("island %d: late contribution(s) to fragment(s) %s wait for their next round: not merged by the end",
                 island, late)
    if open_rounds:
        log.warning("island %d: the round(s) of fragment(s) %s did not close within %.1f s of the end: those "
                    "contributions are not in the global model this island ends with", island, open_rounds, timeout)
    unmerged = len(late) + len(open_rounds)
    merged_any = merged_any or any(a.included for a in inbox.take(lambda a: True))
    if not merged_any:
        log.warning("island %d: none of its contributions was merged into the global model before training ended "
                    "(a run shorter than the sync schedule?); keeping the local weights", island)
        return None, False, unmerged
    plan, missed = {}, {}
    for f in fragments:
        try:
            version, f.base = link.pull(f.number)
            plan[f.number] = version
        except Exception as err:  # keep the local values rather than crash at the very end
            missed[f.number] = err
    if missed:  # e.g. a dead shard: its fragments keep this island's own progress
        log.warning("island %d: could not pull fragment(s) %s of the final global model, keeping their local "
                    "weights: %s", island, sorted(missed), next(iter(missed.values())))
    return plan or None, True, unmerged
