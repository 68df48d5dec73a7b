"""The synchronizer's lock order (docs/design.md#locks-and-their-order), checked on every
acquisition of a join, seed, push, refusal, close, subscription, status and checkpoint.

Order: ``Checkpointer.lock`` before any fragment's ``Fragment.cond``, which comes before
``Run.lock`` and ``Membership.lock``; those two are never held together, and two
fragments' ``cond`` never at once; ``Tally.lock`` (the counters) is last of all. A lock taken
against this order can deadlock with a thread that follows it.
"""

from __future__ import annotations

import threading

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import RoundRequest, VersionUpdate
from lightning_diloco.synchronizer.requests import Refusal
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.helpers import SPECS, FakeClock, contribution, initial_fragments, layout, run_config

RANK = {"checkpointer": 0, "fragment": 1, "run": 2, "membership": 2, "counters": 3}


class Acquisitions:
    """Per thread, the tracked locks held; for the run, every (held, acquired) pair seen."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.pairs: set[tuple[str, str]] = set()
        self.violations: list[str] = []

    def held(self) -> list[str]:
        if not hasattr(self.local, "held"):
            self.local.held = []
        return self.local.held

    def acquired(self, name: str, times: int = 1) -> None:
        held = self.held()
        if name not in held:  # a re-entrant acquisition orders nothing
            kind = name.split("[")[0]
            for other in dict.fromkeys(held):
                self.pairs.add((other.split("[")[0], kind))
                if RANK[other.split("[")[0]] >= RANK[kind]:
                    self.violations.append(f"{name} acquired while holding {other}")
        held.extend([name] * times)

    def released(self, name: str) -> int:
        """Release one hold of ``name``; returns how many holds were dropped."""
        held = self.held()
        held.reverse()
        held.remove(name)
        held.reverse()
        return 1

    def released_all(self, name: str) -> int:
        held = self.held()
        n = held.count(name)
        held[:] = [h for h in held if h != name]
        return n


class TrackedLock:
    """A ``threading.Lock`` that reports to ``Acquisitions`` (usable under a ``Condition``)."""

    def __init__(self, name: str, log: Acquisitions, inner=None) -> None:
        self.name, self.log, self.inner = name, log, inner or threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self.inner.acquire(blocking, timeout)
        if ok:
            self.log.acquired(self.name)
        return ok

    def release(self) -> None:
        self.log.released(self.name)
        self.inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class TrackedRLock(TrackedLock):
    """A ``threading.RLock`` that reports to ``Acquisitions``; a ``Condition`` wait releases every hold."""

    def __init__(self, name: str, log: Acquisitions) -> None:
        super().__init__(name, log, threading.RLock())

    def _is_owned(self) -> bool:
        return self.inner._is_owned()

    def _release_save(self):
        return self.inner._release_save(), self.log.released_all(self.name)

    def _acquire_restore(self, saved) -> None:
        state, holds = saved
        self.inner._acquire_restore(state)
        self.log.acquired(self.name, holds)


def _instrumented(sync: Synchronizer) -> Acquisitions:
    log = Acquisitions()
    for p, fragment in sync.run.fragments.items():
        fragment.cond = threading.Condition(TrackedRLock(f"fragment[{p}]", log))
    sync.run.lock = TrackedRLock("run", log)
    sync.tally.lock = TrackedLock("counters", log)
    membership = sync.membership
    membership.lock = TrackedLock("membership", log)
    membership.changed = threading.Condition(membership.lock)
    sync.checkpointer.lock = TrackedLock("checkpointer", log)
    return log


def test_every_lock_is_taken_in_the_documented_order(tmp_path):
    config = run_config(min_quorum=2, num_fragments=2)
    sync = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path, checkpoint_every=1))
    sync.join(0, 1, SPECS)  # the first join builds the fragments: instrument them before anything else
    log = _instrumented(sync)
    sync.join(1, 1, SPECS)
    sync.join(2, 1, SPECS)
    for p, value in initial_fragments(config).items():
        sync.seed(0, p, get_codec("fp32").encode(value))
    for island in (0, 1):
        sync.heartbeat(island, steps=0, step_time=0.1, schedule_step=0)
    # island 2 has reached round 0 of fragment 0 (due at step 2): with island 0's push the run's
    # clock does too, so island 1, behind it, is asked to send now
    sync.heartbeat(2, steps=2, step_time=0.1, schedule_step=2)
    subscribed = True
    events = sync.subscribe(1, {0: 0, 1: 0}, active=lambda: subscribed, tick=0.01)
    delta = torch.full((layout(config).fragment_numel(0),), 0.01)

    sync.push(contribution(config, 0, 0, delta, seq=5))  # opens round 0: island 1 is asked for it
    assert isinstance(next(events), RoundRequest)
    sync.push(contribution(config, 1, 0, delta, seq=5))
    [closed] = sync.poll()  # the closer's path, on this thread: decide, merge, step, publish, checkpoint
    assert closed.islands == (0, 1)
    update = next(events)
    assert isinstance(update, VersionUpdate) and update.version == 1
    try:
        sync.push(contribution(config, 0, 0, delta, seq=4))  # refused under the fragment's lock
    except Refusal:
        pass
    else:
        raise AssertionError("an older sequence number than one merged must be refused")
    sync.status()
    sync.checkpoint()
    subscribed = False
    sync.shutdown()

    assert log.violations == []
    # the test saw the nestings it guards, so it would see one against the order
    assert {("fragment", "membership"), ("fragment", "counters"), ("checkpointer", "fragment")} <= log.pairs
