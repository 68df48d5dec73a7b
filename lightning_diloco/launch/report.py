"""The run report: goodput and global downtime from sampled progress (pure functions).

The launcher samples, every fraction of a second, each island's inner-step count and the run's
global progress (outer steps for Decoupled DiLoCo, the job's step for the DDP baseline). From
those samples:

- **useful time** of an island: the time its step count advanced by steps that survive to the
  end. A DDP job restarted from a checkpoint rolls back to the checkpoint's step: the time spent
  on the rolled-back steps is not useful. Decoupled DiLoCo islands never roll back.
- **goodput** = sum of useful island-time / allocated island-time, over the training window:
  from the first island step to the last (start-up imports and the final validation are
  excluded for every method alike). An island is allocated from the window's start until it
  finished its work and exited: one that finished early releases its machines.
- **global downtime**: stretches of more than ``STALL_S`` with no global progress while at least
  one island was alive, after the first global progress (start-up is not downtime); reported as
  total and longest stretch. Shorter gaps are the grain of the measurement, not outages: progress
  is sampled every quarter second and an outer step lands every step or two of the fastest
  island, which on a loaded CPU can take longer than a sample period.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_diloco.core.protocol import SynchronizerStatus

STALL_S = 1.0  # seconds without an outer step before a stretch counts as global downtime


@dataclass
class Sample:
    t: float
    global_progress: int
    steps: dict[int, int]
    alive: set[int]


@dataclass
class RunReport:
    method: str
    islands: int
    wall_s: float
    goodput: float
    downtime_total_s: float
    downtime_longest_s: float
    downtime_outside_synchronizer_restarts_s: float
    useful_s: dict[int, float]
    alive_s: dict[int, float]
    final_steps: dict[int, int]
    faults: list[str] = field(default_factory=list)
    restarts: dict[int, int] = field(default_factory=dict)
    recoveries_s: list[float] = field(default_factory=list)
    accepted: dict[int, int] = field(default_factory=dict)
    global_progress: int = 0
    global_series: list[tuple[float, int]] = field(default_factory=list)  # (seconds, global progress) samples

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def summary(self) -> str:
        lines = [
            f"{self.method}: {self.islands} islands, {self.wall_s:.1f}s of training, goodput {self.goodput:.1%}, "
            f"global downtime (stretches over {STALL_S:g}s without an outer step) {self.downtime_total_s:.1f}s total / "
            f"{self.downtime_longest_s:.1f}s longest "
            f"({self.downtime_outside_synchronizer_restarts_s:.1f}s outside synchronizer restarts), "
            f"global progress {self.global_progress}",
            f"faults fired: {len(self.faults)}" + (f" ({'; '.join(self.faults)})" if self.faults else ""),
        ]
        for i in range(self.islands):
            lines.append(
                f"  island {i}: alive {self.alive_s.get(i, 0.0):.1f}s, useful {self.useful_s.get(i, 0.0):.1f}s, "
                f"steps {self.final_steps.get(i, 0)}, restarts {self.restarts.get(i, 0)}, "
                f"contributions accepted {self.accepted.get(i, '-')}"
            )
        if self.recoveries_s:
            lines.append("recoveries (island down to its first accepted contribution after): " + ", ".join(f"{r:.1f}s" for r in self.recoveries_s))
        return "\n".join(lines)


def useful_time(series: Sequence[tuple[float, int]]) -> float:
    """Seconds spent on steps that survive to the end, from (time, step count) samples.

    An increase from one sample to the next credits that interval to the steps it added; a
    decrease (a restart from a checkpoint, or a fresh process starting over at 0 that then
    resumes) rolls back the credit of every step above the new count.
    """
    credits: list[tuple[int, float]] = []  # (step reached, seconds spent reaching it)
    for (t0, s0), (t1, s1) in zip(series, series[1:]):
        if s1 < s0:
            credits = [(s, dt) for s, dt in credits if s <= s1]
        elif s1 > s0:
            credits.append((s1, t1 - t0))
    return sum(dt for _, dt in credits)


def downtime(samples: Sequence[Sample], excluded: Sequence[tuple[float, float]] = (),
             longer_than: float = 0.0) -> tuple[float, float]:
    """(total, longest) seconds without global progress while an island was alive.

    Only stalls that progress ends count: start-up before the first progress and the tail after
    the last one (islands validating and exiting) are not interruptions, and nor are stalls of
    ``longer_than`` seconds or less. Sample intervals overlapping an ``excluded`` (start, end)
    window are not counted: the launcher uses this to tell the synchronizer's own restarts apart.
    """
    total = longest = current = 0.0
    started = False
    for a, b in zip(samples, samples[1:]):
        if b.global_progress > a.global_progress:
            if started and current > longer_than:
                total += current
                longest = max(longest, current)
            started, current = True, 0.0
            continue
        if any(a.t < end and b.t > start for start, end in excluded):
            continue
        if started and (a.alive or b.alive):
            current += b.t - a.t
    return total, longest


class RecoveryClock:
    """Seconds from each island's going down (killed, crashed) to its first accepted contribution
    after its restart.

    The synchronizer counts accepted contributions per incarnation: after its own restart the
    counts start again from zero, so a baseline taken before that restart is reset to zero (an
    island restarted together with the synchronizer was otherwise never seen to recover).
    """

    def __init__(self) -> None:
        self.recoveries: list[float] = []
        self.accepted: dict[int, int] = {}  # per island, in the synchronizer's current incarnation
        self._awaiting: dict[int, tuple[float, int]] = {}  # island -> (restarted at, accepted then)
        self._incarnation = None

    def island_restarted(self, island: int, now: float) -> None:
        self._awaiting[island] = (now, self.accepted.get(island, 0))

    def observe(self, status: SynchronizerStatus, now: float) -> None:
        incarnation = status.incarnation
        if incarnation != self._incarnation:
            if self._incarnation is not None:
                self._awaiting = {i: (since, 0) for i, (since, _) in self._awaiting.items()}
            self._incarnation = incarnation
        self.accepted = {i: island.accepted for i, island in status.islands.items()}
        for i, (since, before) in list(self._awaiting.items()):
            if self.accepted.get(i, 0) > before:
                self.recoveries.append(now - since)
                del self._awaiting[i]


def build_report(method: str, num_islands: int, samples: Sequence[Sample], alive_s: dict[int, float], *,
                 rollback_steps: bool, synchronizer_restarts: Sequence[float] = (),
                 finished_at: dict[int, float] | None = None) -> RunReport:
    """``rollback_steps``: island step counts fall back on restart (DDP) instead of being
    per-process counters that restart at 0 while the island's work is kept (DiLoCo).
    ``synchronizer_restarts``: times the synchronizer went down; each window lasts until the
    first global progress after it. ``finished_at``: when each island completed its work and
    exited; it is not allocated after that."""
    samples = _training_window(samples)
    wall = samples[-1].t - samples[0].t if len(samples) > 1 else 0.0
    useful = {}
    for i in range(num_islands):
        series = [(s.t, s.steps.get(i, 0)) for s in samples]
        useful[i] = useful_time(series) if rollback_steps else _advancing_time(series)
    allocated = _allocated_time(samples, num_islands, finished_at or {})
    total, longest = downtime(samples, longer_than=STALL_S)
    windows = [(down, next((x.t for x in samples if x.t > down and x.global_progress > _progress_at(samples, down)), float("inf")))
               for down in synchronizer_restarts]
    outside, _ = downtime(samples, windows, longer_than=STALL_S)
    goodput = sum(useful.values()) / allocated if allocated > 0 else 0.0
    last = samples[-1] if samples else Sample(0.0, 0, {}, set())
    return RunReport(method=method, islands=num_islands, wall_s=wall, goodput=goodput, downtime_total_s=total,
                     downtime_longest_s=longest, downtime_outside_synchronizer_restarts_s=outside, useful_s=useful, alive_s=dict(alive_s), final_steps=dict(last.steps),
                     global_progress=last.global_progress,
                     global_series=[(round(x.t, 3), x.global_progress) for x in samples])


def _allocated_time(samples: Sequence[Sample], num_islands: int, finished_at: dict[int, float]) -> float:
    if len(samples) < 2:
        return 0.0
    start, end = samples[0].t, samples[-1].t
    return sum(max(0.0, min(finished_at.get(i, end), end) - start) for i in range(num_islands))


def _training_window(samples: Sequence[Sample]) -> Sequence[Sample]:
    """From the sample before the first island step to the last one that saw a step.

    Process start-up (seconds of imports on a CPU) and the final validation are the same for
    every method and not what goodput compares.
    """
    def total(s: Sample) -> int:
        return sum(s.steps.values())

    moving = [k for k in range(1, len(samples)) if total(samples[k]) != total(samples[k - 1])]
    if not moving:
        return samples
    return samples[moving[0] - 1 : moving[-1] + 1]


def _progress_at(samples: Sequence[Sample], t: float) -> int:
    before = [s.global_progress for s in samples if s.t <= t]
    return max(before) if before else 0


def _advancing_time(series: Sequence[tuple[float, int]]) -> float:
    return sum(t1 - t0 for (t0, s0), (t1, s1) in zip(series, series[1:]) if s1 > s0)
