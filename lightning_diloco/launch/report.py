"""The run report: start-up, goodput, global downtime and recoveries from sampled progress.

The launcher samples, every fraction of a second, each island's inner-step count and the run's
global progress (outer steps for Decoupled DiLoCo, the job's step for the DDP baseline); the
report is computed from those samples by the pure functions here. :data:`DEFINITIONS` says what
each figure means; the report file carries it (``to_dict``) and the launcher's ``--help`` prints it.
Sample intervals are the grain of every figure: progress is read every quarter second.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_diloco.core.protocol import SynchronizerStatus

STALL_S = 1.0  # seconds without an outer step before a stretch counts as global downtime
STEP_GAPS = 3.0  # an island's step gap longer than this many of its typical gaps (and STALL_S) is a stall
JOIN_MARGIN_S = 1.0  # no restarted process imports torch and joins faster: a heartbeat sooner is the old one's

DEFINITIONS = {
    "start-up": "launch to an island's first step (imports, data, joining); the first start-up is not counted "
                "against goodput, a restart's is",
    "training": "from the first step of any island to the last one",
    "ending": "last step to the end of the run (final validation, exits)",
    "alive": "seconds an island's processes ran, start-ups and ending included",
    "useful": "training seconds in which an island's step count rose by steps kept to the end (DDP steps a restart "
              f"rolls back are not kept); a step gap over {STEP_GAPS:g} x the island's typical gap (and {STALL_S:g}s) "
              "is a stall, not useful",
    "goodput": "useful / allocated island-seconds; an island is allocated from its first step to its last if it "
               "finished, else to the end of training",
    "global downtime": f"stretches over {STALL_S:g}s of training with no outer step (DDP: no step) while an island "
                       "was alive",
    "recovery": "an island going down (killed, crashed) to the first contribution of its restarted process merged "
                "into the global model",
    "rounds": "outer steps per fragment per H of the islands' steps; contributions merged per outer step; shares of "
              "them merged a round late, scaled down by the guard, and replaced by a newer one of their island; the "
              "run's clock against the islands' steps; contributions not merged by the end, waiting in rounds that "
              "never closed (a late send waits for a next round nobody opened), so not in the final global model "
              "(from the synchronizer's last status)",
}


def rounds_health(status: SynchronizerStatus) -> dict[str, float | None]:
    """How the run's rounds went, from the synchronizer's status (``DEFINITIONS['rounds']``), to
    read beside a loss: a figure from rounds that were mostly late, or from islands restarted out of
    phase, is not the algorithm's (benchmarks/RESULTS.md, Where the main job's points go)."""
    rounds = list(status.rounds.values())
    closed = sum(r.closed for r in rounds)
    merged = sum(r.merged_entries for r in rounds)
    steps = max((i.steps for i in status.islands.values()), default=0)

    def share(part: float, whole: float) -> float | None:
        return part / whole if whole else None

    return {
        "outer_steps_per_fragment_per_h": share(closed * status.sync_every, len(rounds) * steps),
        "contributions_per_outer_step": share(merged, closed),
        "late": share(sum(r.merged_late for r in rounds), merged),
        "clipped": share(sum(r.clipped for r in rounds), merged),
        "superseded": share(sum(r.superseded for r in rounds), merged),
        "clock_per_island_step": share(status.run_step, steps),
        "not_merged": sum(r.open_contributors for r in rounds),
    }


def format_rounds(h: dict) -> str:
    """:func:`rounds_health` as one line; with the islands' side too where ``h`` has it (the
    recipes add the share of due sends skipped, the training loops' wait on the network and their
    time in the sync hook)."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:.0f}%"

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    line = (f"rounds: {num(h['outer_steps_per_fragment_per_h'])} outer steps per fragment per H, "
            f"{num(h['contributions_per_outer_step'])} contributions each, {pct(h['late'])} late, "
            f"{pct(h['clipped'])} scaled down by the guard")
    if "skipped" in h:
        line += f", {pct(h['skipped'])} of due sends skipped"
    line += f", clock {num(h['clock_per_island_step'])}x the islands' steps"
    if "wait_s" in h:
        line += f", training loops waited on the network {h['wait_s']:.1f} s ({pct(h['wait'])} of their run time)"
    if "hook_s" in h:
        line += f" and spent {h['hook_s']:.1f} s ({pct(h['hook'])}) in the sync hook"
    if h.get("not_merged"):
        line += f"; {h['not_merged']} contribution(s) not merged by the end (their rounds never closed)"
    return line


@dataclass
class Sample:
    t: float
    """Seconds since the launch."""
    global_progress: int
    steps: dict[int, int]
    alive: set[int]


@dataclass
class RunReport:
    method: str
    islands: int
    training_s: float
    """The training window's length (``DEFINITIONS['training']``); the recipes' ``wall_s`` is the whole run."""
    goodput: float
    downtime_total_s: float
    downtime_longest_s: float
    downtime_outside_synchronizer_restarts_s: float
    useful_s: dict[int, float]
    alive_s: dict[int, float]
    final_steps: dict[int, int]
    startup_s: dict[int, float | None] = field(default_factory=dict)
    """Per island, launch to first step; None: it never stepped."""
    ending_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    """Why the run failed; empty when every island finished."""
    faults: list[str] = field(default_factory=list)
    restarts: dict[int, int] = field(default_factory=dict)
    recoveries_s: list[float] = field(default_factory=list)
    unrecovered: list[int] = field(default_factory=list)
    """Islands restarted whose new process had no contribution merged by the end."""
    accepted: dict[int, int] = field(default_factory=dict)
    global_progress: int = 0
    global_series: list[tuple[float, int]] = field(default_factory=list)  # (seconds, global progress) samples
    rounds: dict[str, float | None] = field(default_factory=dict)
    """:func:`rounds_health` of the synchronizer's last status (empty for DDP)."""
    definitions: dict[str, str] = field(default_factory=lambda: dict(DEFINITIONS))

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    @property
    def trained(self) -> bool:
        return any(t is not None for t in self.startup_s.values()) or any(self.final_steps.values())

    def to_dict(self) -> dict:
        return {**self.__dict__, "failed": self.failed}

    def summary(self) -> str:
        lines = []
        if self.failed:
            lines.append(f"{self.method}: run FAILED: " + "; ".join(self.failures))
        if not self.trained:
            lines.append(f"{self.method}: no island trained a step; no goodput or downtime to report")
            lines.append(f"faults fired: {len(self.faults)}" + (f" ({'; '.join(self.faults)})" if self.faults else ""))
            return "\n".join(lines)
        starts = ", ".join(f"island {i} {'-' if t is None else f'{t:.1f}s'}" for i, t in sorted(self.startup_s.items()))
        lines += [
            f"{self.method}: {self.islands} islands; start-up {starts}; training {self.training_s:.1f}s; ending {self.ending_s:.1f}s",
            f"goodput {self.goodput:.1%}, global downtime {self.downtime_total_s:.1f}s total / {self.downtime_longest_s:.1f}s "
            f"longest ({self.downtime_outside_synchronizer_restarts_s:.1f}s outside synchronizer restarts), "
            f"global progress {self.global_progress}",
            f"faults fired: {len(self.faults)}" + (f" ({'; '.join(self.faults)})" if self.faults else ""),
        ]
        for i in range(self.islands):
            lines.append(
                f"  island {i}: alive {self.alive_s.get(i, 0.0):.1f}s, useful {self.useful_s.get(i, 0.0):.1f}s, "
                f"steps {self.final_steps.get(i, 0)}, restarts {self.restarts.get(i, 0)}, "
                f"contributions merged {self.accepted.get(i, '-')}"
            )
        if self.rounds:
            lines.append(format_rounds(self.rounds))
        if self.recoveries_s or self.unrecovered:
            lines.append("recoveries: " + ", ".join([f"{r:.1f}s" for r in self.recoveries_s]
                                                   + [f"island {i} not recovered by the end" for i in self.unrecovered]))
        # the definitions once in --help and the report file, not after every run (they ran to 8 lines)
        lines.append("what each figure means: `lightning-diloco run --help`, or the report file's definitions")
        return "\n".join(lines)


def definitions_help() -> str:
    """:data:`DEFINITIONS` as the launcher's ``--help`` ends with them."""
    return "the run report's figures:\n" + "\n".join(
        textwrap.fill(f"{name}: {text}", width=100, initial_indent="  ", subsequent_indent="    ")
        for name, text in DEFINITIONS.items())


def _change_points(series: Sequence[tuple[float, int]]) -> list[tuple[float, int]]:
    """The first sample and every sample whose count differs from the one before."""
    return [p for k, p in enumerate(series) if k == 0 or p[1] != series[k - 1][1]]


def step_gap_limit(series: Sequence[tuple[float, int]]) -> float:
    """The longest gap between an island's step changes that is still training, not a stall:
    STEP_GAPS x its median gap (a step slower than a sample period is not a stall), at least STALL_S."""
    points = _change_points(series)
    gaps = [t1 - t0 for (t0, s0), (t1, s1) in zip(points, points[1:]) if s1 > s0]
    return max(STALL_S, STEP_GAPS * statistics.median(gaps)) if gaps else STALL_S


def useful_time(series: Sequence[tuple[float, int]], *, rollback: bool = True) -> float:
    """Seconds spent on steps that survive to the end, from (time, step count) samples.

    Each gap between two changes of the count that raised it is credited to the steps it added:
    all of it, or, when it is a stall (longer than :func:`step_gap_limit`), only the sample period
    in which the count moved again. With ``rollback`` a decrease (a restart from a checkpoint)
    takes back the credit of every step above the new count; without it (Decoupled DiLoCo: a
    restarted process counts from its own start, the island's work is kept in the global model)
    a decrease only starts a new count.
    """
    limit = step_gap_limit(series)
    credits: list[tuple[int, float]] = []  # (step reached, seconds spent reaching it)
    last_change = series[0] if series else (0.0, 0)
    for (t_before, _), (t, s) in zip(series, series[1:]):
        t0, s0 = last_change
        if s == s0:
            continue
        last_change = (t, s)
        if s < s0:
            if rollback:
                credits = [(step, dt) for step, dt in credits if step <= s]
            continue
        credits.append((s, t - t0 if t - t0 <= limit else t - t_before))
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
    """Seconds from each island's going down (killed, crashed) to the first contribution of its
    restarted process merged into the global model.

    The synchronizer counts merged contributions per island, not per process: entries the dead
    process sent just before it went down are still merged after it. So the count is taken as a
    baseline only once the restarted process has joined (the synchronizer heard from the island
    ``JOIN_MARGIN_S`` after the restart) and a recovery is the first merge past that baseline.
    The synchronizer counts per incarnation: after its own restart a baseline becomes zero.
    """

    def __init__(self) -> None:
        self.recoveries: list[float] = []
        self.accepted: dict[int, int] = {}  # per island, in the synchronizer's current incarnation
        self._down: dict[int, tuple[float, float]] = {}  # island -> (went down at, restarted at)
        self._baseline: dict[int, int] = {}  # island -> merged count when its restarted process joined
        self._incarnation: str | None = None

    def island_restarted(self, island: int, went_down: float, restarted: float) -> None:
        self._down[island] = (went_down, restarted)
        self._baseline.pop(island, None)

    @property
    def unrecovered(self) -> list[int]:
        return sorted(self._down)

    def observe(self, status: SynchronizerStatus, now: float) -> None:
        if status.incarnation != self._incarnation:
            if self._incarnation is not None:
                self._baseline = dict.fromkeys(self._baseline, 0)
            self._incarnation = status.incarnation
        self.accepted = {i: island.accepted for i, island in status.islands.items()}
        for i, (went_down, restarted) in list(self._down.items()):
            island = status.islands.get(i)
            if island is None:
                continue
            if i not in self._baseline:
                if now - island.seen_s_ago > restarted + JOIN_MARGIN_S:  # the restarted process joined
                    self._baseline[i] = island.accepted
            elif island.accepted > self._baseline[i]:
                self.recoveries.append(now - went_down)
                del self._down[i], self._baseline[i]


def build_report(method: str, num_islands: int, samples: Sequence[Sample], alive_s: dict[int, float], *,
                 rollback_steps: bool, synchronizer_restarts: Sequence[float] = (),
                 finished: Sequence[int] = (), ended_at: float | None = None,
                 failures: Sequence[str] = ()) -> RunReport:
    """``rollback_steps``: island step counts fall back on restart (DDP) instead of being
    per-process counters that restart at 0 while the island's work is kept (DiLoCo).
    ``synchronizer_restarts``: times the synchronizer went down; each window lasts until the
    first global progress after it. ``finished``: islands that completed their work; they are
    not allocated after their last step. ``ended_at``: the run's end (default: the last sample).
    ``failures``: why the run failed, if it did."""
    ended_at = ended_at if ended_at is not None else (samples[-1].t if samples else 0.0)
    startup = {i: _first_step_at(samples, i) for i in range(num_islands)}
    window = _training_window(samples)
    trained = len(window) > 1 and any(t is not None for t in startup.values())
    wall = window[-1].t - window[0].t if trained else 0.0
    useful, allocated = {}, 0.0
    for i in range(num_islands):
        series = [(s.t, s.steps.get(i, 0)) for s in window]
        useful[i] = useful_time(series, rollback=rollback_steps) if trained else 0.0
        allocated += _allocated(series, i in finished) if trained else 0.0
    total, longest = downtime(window, longer_than=STALL_S)
    windows = [(down, next((x.t for x in window if x.t > down and x.global_progress > _progress_at(window, down)), float("inf")))
               for down in synchronizer_restarts]
    outside, _ = downtime(window, windows, longer_than=STALL_S)
    goodput = min(1.0, sum(useful.values()) / allocated) if allocated > 0 else 0.0
    last = window[-1] if window else Sample(0.0, 0, {}, set())
    final = samples[-1] if samples else last
    return RunReport(method=method, islands=num_islands, training_s=wall, goodput=goodput, downtime_total_s=total,
                     downtime_longest_s=longest, downtime_outside_synchronizer_restarts_s=outside, useful_s=useful,
                     alive_s=dict(alive_s), final_steps=dict(final.steps), startup_s=startup,
                     ending_s=max(0.0, ended_at - last.t) if trained else 0.0, failures=list(failures),
                     global_progress=final.global_progress,
                     global_series=[(round(x.t, 3), x.global_progress) for x in samples])


def _first_step_at(samples: Sequence[Sample], island: int) -> float | None:
    for a, b in zip(samples, samples[1:]):
        if b.steps.get(island, 0) != a.steps.get(island, 0):
            return b.t
    return None


def _allocated(series: Sequence[tuple[float, int]], finished: bool) -> float:
    """From the sample before the island's first step (the window's start if it never stepped) to
    its last step if it finished, else to the window's end."""
    points = _change_points(series)
    if len(points) < 2:
        return series[-1][0] - series[0][0]
    before_first = max((t for t, _ in series if t < points[1][0]), default=series[0][0])
    end = points[-1][0] if finished else series[-1][0]
    return max(0.0, end - before_first)


def _training_window(samples: Sequence[Sample]) -> Sequence[Sample]:
    """From the sample before the first island step to the last one that saw a step.

    Process start-up (seconds of imports on a CPU) and the final validation are the same for
    every method and not what goodput compares; the report gives them apart.
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
