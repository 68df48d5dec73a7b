"""Goodput at millions of chips: a discrete-event simulation of interruptions (numpy).

    python -m benchmarks.goodput_sim                    # the table: DP, elastic DP, M = 2..16
    python -m benchmarks.goodput_sim --days 3 --seeds 3 --chips 150000 1200000

Goodput = chip-seconds spent on training that is kept / chip-seconds allocated. Every chip fails
independently (Poisson) with a mean time between interruptions of one year; the figures below are
chosen from how such systems work, not fitted to any published table.

Assumptions (each a flag):

* A failure takes out its **slice** of ``--slice`` = 256 chips (one host-level interconnect
  domain: the unit a scheduler swaps). Learners are whole slices.
* **Restart** (``--restart`` = 300 s) of a synchronous job after a failure: detect it (about 30 s
  of missed heartbeats), tear down and reschedule onto a spare slice (about 60 s), start the
  runtime and rebuild the collectives (about 90 s at this scale), restore state (about 60 s) and
  warm up or recompile (about 60 s). A failure inside a restart starts it again: the job needs a
  whole restart without any failure among its chips.
* **Checkpoints** for DP: asynchronous, ``--checkpoint-cost`` = 10 s of stalled training each,
  taken at the Young-Daly interval sqrt(2 x cost x job MTBI); a failure loses the work since the
  last one.
* **Elastic DP** drops the failed slice instead of restarting: a pause of ``--rescale`` = 90 s
  (detect 30 s, re-form the collectives 60 s) for the whole job, with nothing lost; the slice comes
  back after ``--repair`` = 2 h, re-added in a batch every ``--readd-every`` = 30 min, which costs one
  more pause. A failure during a pause extends it.
* **Decoupled DiLoCo** with M learners of N / M chips (contiguous slices). The other learners never
  wait for a failed one (quorum 1); the synchronizer is a few replicated CPU hosts, assumed
  available. Inside a learner (``--learners``): *elastic* (default), the learner is an elastic-DP
  job of its own and only it pauses; *restart*, the learner restarts as above at its own size and
  rejoins by pulling the global model, losing only its progress since its last fragment sync,
  ``--sync-window`` / 2 on average (H = 24 steps of about 5 s).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

import numpy as np

YEAR = 365.0 * 24 * 3600
CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
LEARNERS = (2, 4, 8, 16)


@dataclass
class Assumptions:
    mtbi_years: float = 1.0
    slice: int = 256
    restart: float = 300.0
    checkpoint_cost: float = 10.0
    rescale: float = 90.0
    repair: float = 7200.0
    readd_every: float = 1800.0
    sync_window: float = 120.0
    days: float = 7.0


def failures(rng: np.random.Generator, chips: int, horizon: float, a: Assumptions) -> tuple[np.ndarray, np.ndarray]:
    """(sorted times, failed slice) of every interruption in [0, horizon)."""
    rate = chips / (a.mtbi_years * YEAR)
    n = rng.poisson(rate * horizon)
    return np.sort(rng.uniform(0.0, horizon, n)), rng.integers(0, max(1, chips // a.slice), n)


def restarting_job(times: np.ndarray, horizon: float, restart: float, lose) -> tuple[float, int]:
    """Training seconds kept by a job that restarts after each failure; ``lose(run)`` is the
    training lost when a failure ends a run of ``run`` seconds. Returns (kept, restarts)."""
    kept, up_since, restarts = 0.0, 0.0, 0
    for t in times:
        if t < up_since:  # failed during its restart: the restart begins again
            up_since = t + restart
            continue
        run = t - up_since
        kept += run - lose(run)
        up_since = t + restart
        restarts += 1
    if up_since < horizon:
        kept += horizon - up_since
    return kept, restarts


def data_parallel(times: np.ndarray, chips: int, horizon: float, a: Assumptions) -> float:
    mtbi = a.mtbi_years * YEAR / chips
    interval = math.sqrt(2 * a.checkpoint_cost * mtbi)  # Young-Daly
    period = interval + a.checkpoint_cost

    def lose(run: float) -> float:  # work since the last finished checkpoint, plus the checkpoints' stalls
        return run % period + (run // period) * a.checkpoint_cost

    kept, _ = restarting_job(times, horizon, a.restart, lose)
    return kept / horizon


def elastic_data_parallel(times: np.ndarray, chips: int, horizon: float, a: Assumptions) -> float:
    total = max(1, chips // a.slice)
    # a failed slice is re-added at the first re-add batch after its repair: one pause per batch
    back = np.ceil((times + a.repair) / a.readd_every) * a.readd_every
    batches, returned = np.unique(back[back < horizon], return_counts=True)
    events = sorted([(t, 1) for t in times] + [(t, -int(k)) for t, k in zip(batches, returned)])
    useful, cursor, paused_until, out = 0.0, 0.0, 0.0, 0
    for t, change in events + [(horizon, 0)]:
        running_from = max(cursor, paused_until)
        if t > running_from:
            useful += (t - running_from) * (total - out) / total
        cursor = t
        out += change
        paused_until = max(paused_until, t + a.rescale)  # every change of membership re-forms the job
    return useful / horizon


def decoupled_diloco(times: np.ndarray, slices: np.ndarray, chips: int, learners: int, horizon: float,
                     a: Assumptions, elastic: bool) -> float:
    total_slices = max(learners, chips // a.slice)
    owner = slices * learners // total_slices  # learners are contiguous groups of slices
    goodput = 0.0
    for m in range(learners):
        mine = times[owner == m]
        if elastic:  # the learner drops the failed slice and goes on; the others never notice
            goodput += elastic_data_parallel(mine, chips // learners, horizon, a) / learners
        else:  # the learner restarts and pulls the global model: it loses its unsynced progress
            kept, _ = restarting_job(mine, horizon, a.restart, lambda run: min(run, a.sync_window / 2))
            goodput += kept / horizon / learners
    return goodput


def simulate(chips: int, a: Assumptions, seed: int, elastic_learners: bool = True) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    horizon = a.days * 24 * 3600
    times, slices = failures(rng, chips, horizon, a)
    row = {"DP": data_parallel(times, chips, horizon, a),
           "elastic DP": elastic_data_parallel(times, chips, horizon, a)}
    for m in LEARNERS:
        row[f"Decoupled DiLoCo M={m}"] = decoupled_diloco(times, slices, chips, m, horizon, a, elastic_learners)
    return row


def table(chips: list[int], a: Assumptions, seeds: int, elastic_learners: bool = True) -> tuple[list[str], dict[int, dict[str, float]]]:
    results = {}
    for n in chips:
        runs = [simulate(n, a, seed, elastic_learners) for seed in range(seeds)]
        results[n] = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
    return list(results[chips[0]]), results


def format_table(rows: list[str], results: dict[int, dict[str, float]]) -> str:
    chips = list(results)
    head = "| method | " + " | ".join(f"{n / 1e6:g}M chips" if n >= 1e6 else f"{n // 1000}k chips" for n in chips) + " |"
    lines = [head, "|" + "---|" * (len(chips) + 1)]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(f"{results[n][row] * 100:.1f}%" for n in chips) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chips", type=int, nargs="+", default=list(CHIPS))
    p.add_argument("--seeds", type=int, default=3, help="independent failure draws averaged (default %(default)s)")
    defaults = Assumptions()
    for name, value in vars(defaults).items():
        p.add_argument("--" + name.replace("_", "-"), type=float if isinstance(value, float) else int, default=value)
    p.add_argument("--learners", choices=["elastic", "restart"], default="elastic",
                   help="inside a Decoupled DiLoCo learner, a failure drops its slice (elastic) or restarts the learner")
    args = p.parse_args(argv)
    a = Assumptions(**{k: getattr(args, k) for k in vars(defaults)})
    rows, results = table(args.chips, a, args.seeds, elastic_learners=args.learners == "elastic")
    print(f"goodput over {a.days:g} days, per-chip MTBI {a.mtbi_years:g} year, slices of {a.slice} chips, "
          f"restart {a.restart:g} s, rescale {a.rescale:g} s, repair {a.repair:g} s, {args.learners} learners, "
          f"{args.seeds} seeds")
    print(format_table(rows, results))
    for n, row in results.items():  # the baseline each figure is read against, from the same draws
        best = max((v, k) for k, v in row.items() if k.startswith("Decoupled"))
        print(f"{n:>9,} chips: best {best[1]} {best[0] * 100:.1f}% vs DP {row['DP'] * 100:.1f}%, "
              f"elastic DP {row['elastic DP'] * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
