"""What a recipe run says at its end: the summary result.json holds, and the line that puts the
final figure beside DDP's for the same setting (or the command that measures it)."""

from __future__ import annotations

import argparse
import json
import shlex
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_diloco.core.protocol import SynchronizerStatus
from lightning_diloco.core.settings import given_settings
from lightning_diloco.launch.report import format_rounds, rounds_health

if TYPE_CHECKING:
    from recipes.common import Recipe


def summarize(recipe: Recipe, args: argparse.Namespace, out: Path, wall: float, status: SynchronizerStatus | None) -> dict:
    results = [json.loads(p.read_text()) for p in sorted(out.glob("result-*.json"))]
    if not results:
        raise SystemExit(f"no island wrote a result to {out}; see the output above")
    last = max(results, key=lambda r: r["finished_at"])  # the island that saw the most merged rounds
    params = last["params"]
    processes = args.islands * args.devices
    if args.strategy == "ddp":
        # Ring all-reduce of fp32 gradients: each of the M ranks sends 2 (M-1)/M of the gradient per
        # step; counted between ranks (the processes stand for islands in the comparison).
        across = 2 * (processes - 1) * 4 * params * last["steps"]
        across_how = "computed: ring all-reduce of fp32 gradients"
    else:
        across = sum(r["diloco"].get("diloco/bytes_up", 0) + r["diloco"].get("diloco/bytes_down", 0) for r in results)
        across_how = "measured: fragment payloads sent and received by the islands"
    return {
        "recipe": recipe.name, "preset": args.preset, "strategy": args.strategy, "islands": args.islands,
        "devices": args.devices, "steps": last["steps"], "params": params,
        "tokens": sum(r["tokens"] for r in results), "wall_s": wall, "final": last["final"],
        "bytes_across": across, "bytes_across_how": across_how,
        "outer_steps": status.outer_steps if status else None,
        "rounds_health": run_health(status, results) if status and args.strategy != "ddp" else None,
        "synchronizer": status.to_dict() if status else None,  # its last status: rounds, islands, counters
        "settings": given_settings(args) if args.strategy != "ddp" else {},
        "islands_results": results,
    }


def run_health(status: SynchronizerStatus, results: list[dict]) -> dict:
    """The rounds' health (``lightning_diloco.launch.report.rounds_health``: outer steps per
    fragment per H, contributions per step, shares late, scaled down and superseded, the clock
    against the islands' steps) and what the islands saw of it: the share of due sends skipped
    (the fragment was still in flight), the time their training loops waited on the network (for
    rounds to close: synchronous DiLoCo only) and the time they spent in the sync hook altogether
    (that wait, and the hook's own copies and applies), each against their run time."""
    d = [r["diloco"] for r in results]
    sent, skipped = sum(x.get("diloco/syncs_sent", 0) for x in d), sum(x.get("diloco/syncs_skipped", 0) for x in d)
    waited = sum(x.get("diloco/network_wait_s", 0) for x in d)
    hook = sum(x.get("diloco/blocked_s", 0) for x in d)
    run_time = sum(r["finished_at"] for r in results)
    return {
        **rounds_health(status),
        "skipped": skipped / (sent + skipped) if sent + skipped else None,
        "wait_s": waited,
        "wait": waited / run_time if run_time else None,
        "hook_s": hook,
        "hook": hook / run_time if run_time else None,
    }


def format_summary(recipe: Recipe, args: argparse.Namespace, s: dict, argv: list[str] = ()) -> str:
    final = s["final"]
    lines = [f"{recipe.name} ({s['preset']}, {s['strategy']}, M={s['islands']}): "
             + ", ".join(f"{k} {v:.4f}" for k, v in final.items())]
    if args.strategy != "ddp":
        lines.append("  " + reference_line(recipe, args, final[recipe.metric], argv))
    if s.get("rounds_health"):
        lines.append("  " + format_rounds(s["rounds_health"]))
    lines.append(f"  tokens {s['tokens']:,.0f}, wall-clock {s['wall_s']:.0f} s, outer steps {s['outer_steps']}, "
                 f"bytes across islands {s['bytes_across'] / 1e6:.2f} MB ({s['bytes_across_how']})")
    picture = f"the eval curve {s['plot']}, " if s.get("plot") else ""
    lines.append(f"  results in {args.out}: {picture}result.json, eval curves curve-*.csv, CSV logs logs/, run report "
                 "run-report.json, each process's output run/*.log")
    return "\n".join(lines)


def plot_curve(recipe: Recipe, args: argparse.Namespace, out: Path, s: dict) -> Path | None:
    """``<metric>-curve.png`` in ``out``: the global model's eval curve against training tokens,
    DDP's final figure for this setting as a band (mean +- std of its seeds), and the rounds'
    health in the title; None when no island wrote a curve."""
    if not list(out.glob("curve-*.csv")):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from recipes.compare import curve

    points = curve(out, args.strategy == "ddp")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    label = "DDP" if args.strategy == "ddp" else f"Decoupled DiLoCo, {args.islands} islands (global model)"
    ax.plot([p["tokens"] for p in points], [p[recipe.metric] for p in points], marker=".", label=label)
    ref = recipe.presets[args.preset].reference
    if ref is not None and ref.applies(recipe, args):
        ax.axhline(ref.mean, color="black", linestyle="--", linewidth=1,
                   label=f"DDP, {ref.processes} processes, final ({ref.seeds} seeds)")
        ax.axhspan(ref.mean - ref.std, ref.mean + ref.std, color="black", alpha=0.08)
    health = s.get("rounds_health")
    title = f"{recipe.name} ({s['preset']}): final {recipe.metric} {s['final'][recipe.metric]:.4f}"
    if health:
        title += "\n" + textwrap.fill(format_rounds(health), width=120)  # the whole line, wrapped to the figure
    ax.set_title(title, fontsize=7)
    ax.set_xlabel("training tokens (all islands)")
    ax.set_ylabel(recipe.metric)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / f"{recipe.metric}-curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def reference_line(recipe: Recipe, args: argparse.Namespace, value: float, argv: Sequence[str] = ()) -> str:
    """DDP's figure for this very setting and this run's gap to it, or how to measure one."""
    ref = recipe.presets[args.preset].reference
    if ref is not None and ref.applies(recipe, args):
        gap = (f"{(value - ref.mean) * 100:+.2f} points" if recipe.metric == "accuracy"
               else f"{(value - ref.mean) / ref.mean * 100:+.1f}%")
        return (f"DDP, {ref.processes} processes, same preset, steps, batch and lr: {recipe.metric} {ref.mean:.4f} "
                f"+- {ref.std:.4f} over {ref.seeds} seeds (README's results table); this run {gap}")
    dropped = {"--strategy", "--chaos", "--stagger", "--slow-island", "--slowdown", "--resume", "--verbose", "--out", "--wandb"}
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in dropped:
            skip = "=" not in a and name not in ("--resume", "--verbose", "--wandb")
            continue
        kept.append(a)
    command = shlex.join(["python", "-m", recipe.module, "--strategy", "ddp", *kept, "--out", f"{args.out}-ddp"])
    return f"no DDP reference for this setting in the README; measure one with the same arguments: {command}"
