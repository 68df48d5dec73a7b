"""One slow island: global training throughput, Decoupled DiLoCo against DDP and the ideal.

    python -m benchmarks.stragglers [--islands 4] [--slowdown 3] [--steps 240]

Island 1 of M (DDP: rank 1) takes ``--slowdown`` times as long per step (its emulated step time,
``--step-seconds``, is stretched: a slower chip, or one sharing its host). Three arms through the
launcher, same model and data:

* *ideal*: M islands that never synchronize, so each runs at its own speed; their summed
  throughput is the most any method could get from this hardware;
* *Decoupled DiLoCo*: M islands and a synchronizer (quorum 1: nobody waits for the straggler);
* *DDP*: one M-process job; every step waits for the slowest rank.

Throughput is global training tokens per second: the sum over units (islands; the DDP job) of
each unit's steps per second from its warm-up to its last step, from the launcher's progress
samples (so staggered start-up times do not count).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from lightning_diloco.core.settings import config_with
from lightning_diloco.launch.run import Run, RunOptions

ROOT = Path(__file__).resolve().parents[1]
WARM = 10  # steps before a unit's speed counts (imports, first syncs)


def unit_rate(samples, unit: int, steps: int, warm: int = WARM) -> float:
    """A unit's steps per second from its warm-up step to its last, from the launcher's samples."""
    first = next((s for s in samples if s.steps.get(unit, 0) >= warm), None)
    last = next((s for s in samples if s.steps.get(unit, 0) >= steps), samples[-1])
    if first is None or last.t <= first.t:
        raise RuntimeError(f"unit {unit} made no measurable progress past step {warm}; raise --steps")
    return (last.steps[unit] - first.steps[unit]) / (last.t - first.t)


def run_arm(args: argparse.Namespace, arm: str, workdir: Path) -> float:
    options = RunOptions(
        islands=args.islands, workdir=str(workdir / arm), max_restarts=0, baseline="ddp" if arm == "ddp" else None,
        run_config=config_with({"num_fragments": args.num_fragments, "sync_every": args.sync_every, "overlap_steps": 1}),
    )
    command = [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--steps", str(args.steps),
               "--step-seconds", str(args.step_seconds), "--slow-unit", "1", "--slowdown", str(args.slowdown),
               "--hidden", "32", "--layers", "1", "--checkpoint-every", "100000"]
    if arm == "ideal":
        command.append("--independent")
    run = Run(options, command)
    run.echo = lambda line: None  # the islands' chatter is not the result
    try:
        run.start()
        code = run.loop()
    finally:
        run.shutdown()
    if code != 0:
        raise RuntimeError(f"the {arm} arm failed; run it by hand: {' '.join(command)}")
    units = [0] if arm == "ddp" else list(range(args.islands))
    per_step = args.batch * args.seq * (args.islands if arm == "ddp" else 1)  # DDP: one step is M batches
    return sum(unit_rate(run.samples, u, args.steps) for u in units) * per_step


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--islands", type=int, default=4)
    p.add_argument("--slowdown", type=float, default=3.0)
    p.add_argument("--steps", type=int, default=240, help="steps per island (DDP: of the job)")
    p.add_argument("--step-seconds", type=float, default=0.05, help="emulated step time of a normal island")
    p.add_argument("--num-fragments", type=int, default=4)
    p.add_argument("--sync-every", type=int, default=8)
    args = p.parse_args(argv)
    args.batch, args.seq = 16, 32  # examples/train_lm.py's defaults
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="diloco-stragglers-") as tmp:
        rates = {arm: run_arm(args, arm, Path(tmp)) for arm in ("ideal", "diloco", "ddp")}
    result = {
        **{f"{arm}_tokens_per_s": rate for arm, rate in rates.items()},
        "diloco_vs_ddp": rates["diloco"] / rates["ddp"],
        "diloco_vs_ideal": rates["diloco"] / rates["ideal"],
        "ddp_vs_ideal": rates["ddp"] / rates["ideal"],
    }
    print(f"stragglers: {args.islands} islands, island 1 slowed {args.slowdown:g}x "
          f"(step {args.step_seconds:g} s, {args.step_seconds * args.slowdown:g} s for the straggler)")
    print(f"{'arm':<20} {'tokens/s':>10} {'vs ideal':>9}")
    for arm, name in (("ideal", "ideal (no sync)"), ("diloco", "decoupled diloco"), ("ddp", "ddp")):
        print(f"{name:<20} {rates[arm]:>10.0f} {rates[arm] / rates['ideal']:>9.2f}")
    print(f"throughput ratio diloco / ddp: {result['diloco_vs_ddp']:.2f}")
    return result


if __name__ == "__main__":
    main()
