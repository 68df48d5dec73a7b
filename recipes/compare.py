"""Decoupled DiLoCo with M islands against DDP with M processes, at equal tokens and global batch.

    python -m recipes.compare --recipe text_lm --preset cpu-tiny            # dense text, M = 4
    python -m recipes.compare --recipe text_lm --preset cpu-tiny-moe        # mixture of experts
    python -m recipes.compare --recipe vision --preset cpu-tiny
    python -m recipes.compare --recipe text_lm --preset cpu-tiny --sweep    # + the outer-settings sweep

Each arm is the recipe run as its own command (a synchronizer and M island processes, or one
M-process DDP job). Writes OUT/results.md (the table), OUT/results.json, and PNG plots of the eval
metric against tokens and against wall-clock; with --wandb the arms are one W&B group and the
table and plots are logged to it too. Arguments after ``--`` go to every arm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from lightning_diloco.core import presets
from lightning_diloco.core.settings import value_of

if __package__ in (None, ""):  # run as a file: make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECIPES = {"text_lm": ("recipes.text_lm", "eval_loss"), "vision": ("recipes.vision", "accuracy")}

# The sweep: each arm names every setting it uses (the paper's value unless the arm changes it), so
# the table reads without the presets. A value may be a function of the island count M.
PAPER = {name: value_of(presets.paper(), name) for name in (
    "outer_lr", "outer_momentum", "merge", "apply", "sync_every", "uplink_codec", "downlink_codec", "min_quorum")}
SWEEP = {
    "paper defaults (lr 0.7, mom 0.9)": {},
    "parameter averaging (lr 1, mom 0)": dict(outer_lr=1.0, outer_momentum=0.0),
    "mom 0.5": dict(outer_momentum=0.5),
    "H 12": dict(sync_every=12),
    "H 48": dict(sync_every=48),
    "apply mix": dict(apply="mix"),
    "apply rebase": dict(apply="rebase"),
    "fp32 codecs": dict(uplink_codec="fp32", downlink_codec="fp32"),
    "inner lr x2": dict(lr="x2"),
    "quorum M (synchronous)": dict(min_quorum=lambda islands: islands),
    "merge mean": dict(merge="mean"),
}


def flags(settings: dict, base_lr: float | None, islands: int) -> list[str]:
    out = []
    for key, value in settings.items():
        if callable(value):
            value = value(islands)
        if key == "lr":
            if base_lr is None:
                raise SystemExit("the inner-lr arm needs the preset's learning rate")
            value = base_lr * 2 if value == "x2" else value
        out.append(f"--{key.replace('_', '-')}={value}")
    return out


def run_arm(module: str, out: Path, args: argparse.Namespace, extra: list[str], passthrough: list[str],
            reusable: bool = True) -> dict:
    cmd = [sys.executable, "-m", module, f"--preset={args.preset}", f"--islands={args.islands}", f"--out={out}", *extra]
    if args.steps:
        cmd.append(f"--steps={args.steps}")
    if args.wandb:
        cmd += ["--wandb", f"--wandb-group={args.group}", f"--wandb-project={args.wandb_project}"]
    cmd += passthrough
    print(f"[compare] {' '.join(cmd)}", flush=True)
    if args.reuse and reusable and (out / "command.txt").exists() and (out / "command.txt").read_text() == " ".join(cmd[1:]) \
            and (out / "result.json").exists():
        print("[compare] reusing the finished run with this exact command", flush=True)
        return json.loads((out / "result.json").read_text())
    started = time.time()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out / "output.log").parent.mkdir(parents=True, exist_ok=True)
    (out / "output.log").write_text(done.stdout)
    (out / "command.txt").write_text(" ".join(cmd[1:]))
    if done.returncode != 0 or not (out / "result.json").exists():
        raise SystemExit(f"arm failed ({' '.join(cmd)}), exit {done.returncode}; its output is in {out / 'output.log'}:\n"
                         + done.stdout[-3000:])
    print(f"[compare] done in {time.time() - started:.0f} s", flush=True)
    return json.loads((out / "result.json").read_text())


def curve(out: Path, ddp: bool) -> list[dict]:
    """The eval curve (island 0's, for Decoupled DiLoCo) with ``tokens`` trained by all islands.

    Islands start and run at slightly different speeds, so at island 0's step s the others are
    not at s: their progress at the same wall-clock time is read off their own curves.
    """
    import csv

    import numpy as np

    def read(path: Path) -> list[dict]:
        with open(path) as f:
            return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]

    if ddp:
        return read(out / "curve-ddp.csv")
    islands = [read(path) for path in sorted(out.glob("curve-island*.csv"))]
    first = islands[0]
    per_step = first[-1]["tokens"] / first[-1]["step"] / len(islands)  # one island's tokens per step
    for row in first:
        steps = sum(np.interp(row["wall_s"], [0.0] + [r["wall_s"] for r in rows], [0.0] + [r["step"] for r in rows])
                    for rows in islands)
        row["tokens"] = steps * per_step
    return first


def table(rows: list[tuple[str, dict]], metric: str) -> str:
    ddp = rows[0][1]["final"][metric]
    lower_better = metric == "eval_loss"
    head = f"| arm | {metric} | vs DDP | {'perplexity | ' if lower_better else ''}tokens | wall-clock s | bytes across islands |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in rows:
        value = r["final"][metric]
        gap = f"{(value - ddp) / ddp * 100:+.1f}%" if lower_better else f"{(value - ddp) * 100:+.2f} pts"
        ppl = f"{r['final']['perplexity']:.3f} | " if lower_better else ""
        shown = f"{value:.4f}" if lower_better else f"{value * 100:.2f}%"
        lines.append(f"| {name} | {shown} | {gap if r['strategy'] != 'ddp' else '-'} | {ppl}{r['tokens']:,.0f} | "
                     f"{r['wall_s']:.0f} | {r['bytes_across'] / 1e6:.2f} MB |")
    return "\n".join(lines)


def plot(arms: list[tuple[str, Path, bool]], metric: str, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for x, label in (("tokens", "training tokens (all islands)"), ("wall_s", "wall-clock seconds")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, folder, ddp in arms:
            points = curve(folder, ddp)
            ax.plot([p[x] for p in points], [p[metric] for p in points], label=name, marker="." if ddp else None)
        ax.set_xlabel(label)
        ax.set_ylabel(metric)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{metric}-vs-{x}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", choices=sorted(RECIPES), default="text_lm", help="(default %(default)s)")
    p.add_argument("--preset", default="cpu-tiny", help="one of the recipe's presets (its --help lists them; default %(default)s)")
    p.add_argument("--islands", type=int, default=4, help="M: islands and DDP processes (default %(default)s)")
    p.add_argument("--steps", type=int, help="inner steps (default: the preset's)")
    p.add_argument("--sweep", action="store_true", help=f"also run the outer-settings sweep ({len(SWEEP)} arms)")
    p.add_argument("--only", action="append", default=[], help="run only the sweep arms whose name contains this")
    p.add_argument("--out", help="default runs/compare-<recipe>-<preset>")
    p.add_argument("--reuse", action="store_true",
                   help="keep DDP and sweep arms already run with the same command in OUT (the preset's model unchanged)")
    p.add_argument("--wandb", action="store_true")
    p.add_argument("--wandb-project", default="lightning-diloco")
    args = p.parse_args(argv)
    module, metric = RECIPES[args.recipe]
    base_lr = _preset_lr(module, args.preset)  # a misspelt preset is refused before any folder is made
    out = Path(args.out or f"runs/compare-{args.recipe}-{args.preset}")
    out.mkdir(parents=True, exist_ok=True)
    args.group = out.resolve().name

    ddp_dir, diloco_dir = out / "ddp", out / "diloco"
    rows = [(f"DDP, {args.islands} processes", run_arm(module, ddp_dir, args, ["--strategy=ddp"], passthrough))]
    arms = [(rows[0][0], ddp_dir, True)]
    preset = run_arm(module, diloco_dir, args, [], passthrough, reusable=False)  # the preset may have changed
    rows.append((f"Decoupled DiLoCo, {args.islands} islands (preset)", preset))
    arms.append((rows[-1][0], diloco_dir, False))
    if args.sweep:
        for i, (name, change) in enumerate(SWEEP.items()):
            if args.only and not any(s in name for s in args.only):
                continue
            folder = out / f"sweep-{i:02d}"
            rows.append((name, run_arm(module, folder, args, flags({**PAPER, **change}, base_lr, args.islands), passthrough)))
            arms.append((name, folder, False))
    text = table(rows, metric)
    settings = "\n".join(f"- {name}: `{json.dumps(r['settings'])}`" for name, r in rows if r["strategy"] != "ddp")
    plots = plot(arms[:2] if args.sweep else arms, metric, out)
    (out / "results.md").write_text(f"{text}\n\nSettings of each Decoupled DiLoCo arm:\n{settings}\n")
    (out / "results.json").write_text(json.dumps([{"arm": n, **{k: v for k, v in r.items() if k != "islands_results"}}
                                                  for n, r in rows], indent=2))
    print("\n" + text + f"\n\ntable: {out / 'results.md'}; plots: {', '.join(str(x) for x in plots)}", flush=True)
    if args.wandb:
        _log_wandb(args, out, text, plots)
    return 0


def _preset_lr(module: str, preset: str) -> float | None:
    import importlib

    presets = importlib.import_module(module).PRESETS
    if preset not in presets:
        raise SystemExit(f"--preset={preset!r} is not one of {sorted(presets)}")
    return presets[preset].lr


def _log_wandb(args: argparse.Namespace, out: Path, text: str, plots: list[Path]) -> None:
    import wandb

    from recipes.common import start_wandb

    run = start_wandb(argparse.Namespace(**vars(args), out=str(out), wandb_group=args.group), out, name="compare")
    run.log({"results": wandb.Html(f"<pre>{text}</pre>"), **{p.stem: wandb.Image(str(p)) for p in plots}})
    run.finish()


if __name__ == "__main__":
    sys.exit(main())
