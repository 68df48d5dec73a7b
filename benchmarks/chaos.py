"""Goodput under faults: Decoupled DiLoCo (M islands) vs DDP with checkpoint-restart, same schedule.

    python -m benchmarks.chaos [--islands 4] [--steps 600] [--schedule "kill 1 at 25s; ..."]

Both arms run ``examples/train_lm.py`` through ``lightning-diloco run`` under the same fault
schedule (times from launch); the DDP arm is ``--baseline ddp``: one job over M processes that is
torn down and resumed from its last checkpoint whenever any rank dies. Prints each arm's goodput
(useful island-time over allocated island-time in the training window) and global downtime, and
the goodput ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from lightning_diloco.launch.supervisor import clean_environment
from recipes.processes import run_tree

ROOT = Path(__file__).resolve().parents[1]
ARM_TIMEOUT_S = 3600  # seconds per arm before it counts as failed (and is stopped with its islands)
DEFAULT_SCHEDULE = "kill 1 at 25s; pause 2 at 32s for 6s; kill 3 at 38s"


def run_arm(args: argparse.Namespace, baseline: bool, workdir: Path) -> dict:
    report = workdir / ("ddp.json" if baseline else "diloco.json")
    cmd = [
        sys.executable, "-m", "lightning_diloco.cli", "run", "--islands", str(args.islands), "--workdir", str(workdir / ("ddp" if baseline else "diloco")),
        "--report", str(report), "--chaos", args.schedule, "--restart-backoff", "0",
        f"--sync=--num-fragments={args.num_fragments}", f"--sync=--sync-every={args.sync_every}", "--sync=--overlap-steps=1",
        *(["--baseline", "ddp"] if baseline else []),
        "--", sys.executable, str(ROOT / "examples" / "train_lm.py"), "--steps", str(args.steps),
        "--step-seconds", str(args.step_seconds), "--hidden", "32", "--layers", "1",
        "--checkpoint-every", str(args.checkpoint_every),
    ]
    done = run_tree(cmd, capture_output=True, text=True, cwd=ROOT, env=clean_environment({}), timeout=ARM_TIMEOUT_S)
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"{'ddp' if baseline else 'diloco'} arm failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    return json.loads(report.read_text())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--islands", type=int, default=4)
    parser.add_argument("--steps", type=int, default=900, help="inner steps per island (DDP: steps of the job)")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="extra sleep per step: a bigger model's step time")
    parser.add_argument("--schedule", default=DEFAULT_SCHEDULE)
    parser.add_argument("--num-fragments", type=int, default=4)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (both arms: a killed unit resumes from its last one)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="diloco-chaos-") as tmp:
        diloco = run_arm(args, False, Path(tmp))
        ddp = run_arm(args, True, Path(tmp))
    result = {
        "diloco_goodput": diloco["goodput"],
        "ddp_goodput": ddp["goodput"],
        "goodput_ratio": diloco["goodput"] / ddp["goodput"] if ddp["goodput"] else float("inf"),
        "diloco_downtime_s": diloco["downtime_total_s"],
        "ddp_downtime_s": ddp["downtime_total_s"],
        "faults": diloco["faults"],
        "ddp_faults": ddp["faults"],
    }
    print(f"chaos benchmark: {args.islands} islands, {args.steps} steps each, schedule: {args.schedule}")
    print(f"{'method':<26} {'goodput':>8} {'downtime s':>11} {'longest s':>10} {'faults':>7}")
    for name, rep in (("decoupled diloco", diloco), ("ddp checkpoint-restart", ddp)):
        print(f"{name:<26} {rep['goodput']:>8.1%} {rep['downtime_total_s']:>11.2f} {rep['downtime_longest_s']:>10.2f} {len(rep['faults']):>7}")
    print(f"goodput ratio diloco / ddp: {result['goodput_ratio']:.2f}")
    return result


if __name__ == "__main__":
    main()
