"""Slow links: time to reach a target eval loss, DDP against Decoupled DiLoCo, at a few link rates.

    python -m benchmarks.wan [--rates 20 100] [--islands 4] [--steps 200] [--sparse]

The islands (DDP ranks) sit in their own network namespaces as in bandwidth.py, each link capped
with ``tc ... tbf`` at the rate in both directions (no emulated latency: this kernel has no
netem). Both arms train the same model on the same data for the same steps; the target is the
worse of the two final eval losses (full validation set, global model), so both reach it, and each arm's time is the first
evaluation point at or below it, counted from the start of training (imports and joins
excluded). Prints the speedup DDP time / Decoupled DiLoCo time per rate. ``--sparse`` adds a
second DiLoCo arm, ``presets.sparse()`` with the output head in int2, timed to its own target (the
worse of its and DDP's final losses). Needs root; prints why and exits 0 where namespaces are
not available.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.netns import Namespaces, unavailable
from benchmarks.netrun import ArmResult, run_arm
from lightning_diloco.core import presets
from lightning_diloco.core.settings import changed_settings, setting_flags


def time_to(curve: list[dict], target: float) -> float | None:
    return next((row["seconds"] for row in curve if row["val_loss"] <= target), None)


def main(argv: list[str] | None = None) -> list[dict] | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[20.0, 100.0], help="link rates in Mbit/s")
    p.add_argument("--islands", type=int, default=4)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-fragments", type=int, default=8)
    p.add_argument("--sync-every", type=int, default=24)
    p.add_argument("--sparse", action="store_true", help="also time presets.sparse() (density 1/64, the head in int2)")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"wan benchmark skipped: {why}")
        return None
    batch, seq = 16, 32
    train = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", "64", "--seq", str(seq),
             "--batch", str(batch), "--eval-every", str(args.eval_every)]
    sync = [f"--num-fragments={args.num_fragments}", f"--sync-every={args.sync_every}", "--overlap-steps=2",
            "--uplink-codec=int4", "--downlink-codec=int4", "--outer-momentum=0.5"]  # the library's quorum 1
    diloco = {"int4": sync}
    if args.sparse:  # the same run with the sparse preset's codecs (its flags come after, and win)
        diloco["sparse 1/64"] = sync + setting_flags(changed_settings(presets.sparse(dense_tensors="*lm_head.weight")))
    rows = []
    with tempfile.TemporaryDirectory(prefix="diloco-wan-") as tmp:
        for rate in args.rates:
            with Namespaces(args.islands, rate_mbit=rate) as ns:
                ddp = run_arm(ns, True, train, [], Path(tmp) / f"ddp-{rate:g}", batch * seq, args.steps)
                arms: dict[str, ArmResult] = {
                    codecs: run_arm(ns, False, train, flags, Path(tmp) / f"diloco-{i}-{rate:g}", batch * seq, args.steps)
                    for i, (codecs, flags) in enumerate(diloco.items())}
            for codecs, arm in arms.items():
                target = max(ddp.val_loss, arm.val_loss)
                ddp_s, diloco_s = time_to(ddp.curve, target), time_to(arm.curve, target)
                rows.append({"rate_mbit": rate, "codecs": codecs, "target": target, "ddp_s": ddp_s, "diloco_s": diloco_s,
                             "speedup": ddp_s / diloco_s if ddp_s and diloco_s else None,
                             "ddp_step_s": ddp.curve[-1]["seconds"] / args.steps,
                             "diloco_step_s": arm.curve[-1]["seconds"] / args.steps,
                             "ddp_loss": ddp.val_loss, "diloco_loss": arm.val_loss})
    print(f"wan: {args.islands} islands / DDP ranks, links capped with tbf, {args.steps} steps, "
          f"H = {args.sync_every}, P = {args.num_fragments}")
    print(f"{'Mbit/s':>7} {'codecs':>12} {'target':>7} {'DDP s':>7} {'DiLoCo s':>9} {'speedup':>8} {'DDP s/step':>11} "
          f"{'DiLoCo s/step':>14}")
    for r in rows:
        fmt = lambda v: f"{v:.1f}" if v is not None else "n/a"  # noqa: E731
        speed = f"{r['speedup']:.1f}x" if r["speedup"] else "n/a"
        print(f"{r['rate_mbit']:>7g} {r['codecs']:>12} {r['target']:>7.3f} {fmt(r['ddp_s']):>7} {fmt(r['diloco_s']):>9} "
              f"{speed:>8} {r['ddp_step_s']:>11.3f} {r['diloco_step_s']:>14.3f}")
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
