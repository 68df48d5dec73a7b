"""What a recipe run says at its end: the summary result.json holds, the lines that put the final
figure beside DDP's and synchronous DiLoCo's for the same setting (or the commands that measure
them), and the picture of the eval curve."""

from __future__ import annotations

import argparse
import json
import shlex
import textwrap
from collections.abc import Sequence
from pathlib import Path

from lightning_diloco.core.protocol import SynchronizerStatus
from lightning_diloco.core.settings import given_settings
from lightning_diloco.launch.report import format_rounds, rounds_health
from recipes.common import ARMS, DDP, SYNCHRONOUS, Arm, Recipe, Reference


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
        lines += ["  " + line for line in reference_lines(recipe, args, final[recipe.metric], argv)]
    if s.get("rounds_health"):
        lines.append("  " + format_rounds(s["rounds_health"]))
    lines.append(f"  tokens {s['tokens']:,.0f}, wall-clock {s['wall_s']:.0f} s, outer steps {s['outer_steps']}, "
                 f"bytes across islands {s['bytes_across'] / 1e6:.2f} MB ({s['bytes_across_how']})")
    picture = f"the eval curve {s['plot']}, " if s.get("plot") else ""
    lines.append(f"  results in {args.out}: {picture}result.json, eval curves curve-*.csv, CSV logs logs/, run report "
                 "run-report.json, each process's output run/*.log")
    return "\n".join(lines)


def global_curve(recipe: Recipe, args: argparse.Namespace, out: Path, s: dict) -> list[tuple[float, float]]:
    """The picture's curve as (tokens, metric) points: the global model's eval points (island 0's,
    or DDP rank 0's) against all islands' tokens, ending at the final evaluation the summary
    reports. That takes the place of the point at the last step, which scores the curve's few
    samples (text cpu-tiny: about 0.04 higher in loss than the final's, for the same model) and,
    for Decoupled DiLoCo, the global model before the last rounds closed."""
    from recipes.compare import curve

    points = [(p["tokens"], p[recipe.metric]) for p in curve(out, args.strategy == "ddp") if p["step"] < s["steps"]]
    return [*points, (float(s["tokens"]), s["final"][recipe.metric])]


def plot_curve(recipe: Recipe, args: argparse.Namespace, out: Path, s: dict) -> Path | None:
    """``<metric>-curve.png`` in ``out``: the global model's eval curve against training tokens,
    ending at the final evaluation; the recorded references for this setting (DDP's eval curve
    where one is recorded, each arm's final figure as a band: mean +- std of its seeds); the gap
    and the rounds' health in the title. None when no island wrote a curve."""
    if not list(out.glob("curve-*.csv")):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, final = recipe.metric, s["final"][recipe.metric]
    points = global_curve(recipe, args, out, s)
    fig, ax = plt.subplots(figsize=(7, 4.6))
    label = "DDP (this run)" if args.strategy == "ddp" else f"Decoupled DiLoCo, {args.islands} islands (global model)"
    line, = ax.plot([x for x, _ in points], [y for _, y in points], marker=".", label=label)
    ax.plot(*points[-1], marker="o", markersize=7, color=line.get_color())
    ax.annotate(f"{final:.4f}", points[-1], textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7,
                color=line.get_color())
    ddp = applicable(recipe, args, DDP)
    refs = [(arm, ref) for arm in ARMS if (ref := applicable(recipe, args, arm)) is not None]
    styles = {DDP.name: dict(color="black", linestyle="--"), SYNCHRONOUS.name: dict(color="tab:green", linestyle=":")}
    for arm, ref in refs:
        style = styles[arm.name]
        recorded = ref.curve_points()
        if recorded:
            xs, ys, sd = ([r[k] for r in recorded] for k in ("tokens", metric, "std"))
            ax.plot(xs, ys, color=style["color"], linewidth=1, marker=".", markersize=3,
                    label=f"{arm_label(arm, ref.processes)}: eval curve ({ref.seeds} seeds, mean +- std)")
            ax.fill_between(xs, [y - e for y, e in zip(ys, sd)], [y + e for y, e in zip(ys, sd)], color=style["color"], alpha=0.1)
        of_ddp = f", {format_gap(recipe, gap(recipe, ref.mean, ddp.mean))} of DDP" if ddp is not None and ref is not ddp else ""
        ax.axhline(ref.mean, linewidth=1, **style,
                   label=f"{arm_label(arm, ref.processes)}: final {ref.mean:.4f} +- {ref.std:.4f} ({ref.seeds} seeds{of_ddp})")
        ax.axhspan(ref.mean - ref.std, ref.mean + ref.std, color=style["color"], alpha=0.08)
    # from the second point on: the end, where the arms part, stays readable
    shown = [y for _, y in points[1:]] + [r.mean + d for _, r in refs for d in (-r.std, r.std)]
    lo, hi = min(shown), max(shown)
    if hi > lo:
        ax.set_ylim(lo - 0.1 * (hi - lo), hi + 0.1 * (hi - lo))
    title = f"{recipe.name} ({s['preset']}): final {metric} {final:.4f}"
    if ddp is not None and args.strategy != "ddp":
        title += f" ({format_gap(recipe, gap(recipe, final, ddp.mean))} of DDP)"
    health = s.get("rounds_health")
    if health:
        title += "\n" + textwrap.fill(format_rounds(health), width=120)  # the whole line, wrapped to the figure
    ax.set_title(title, fontsize=7)
    ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1e6:g}M")
    ax.set_xlabel(f"training tokens (all islands); a point every {args.eval_every} steps on {args.eval_batches * args.batch} "
                  f"held-out samples;\nthe last: the final evaluation, on {args.final_eval_batches * args.batch} (other samples: part of the last segment's change)", fontsize=7)
    ax.set_ylabel(metric)
    ax.legend(fontsize=6.5)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / f"{metric}-curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the references ---------------------------------------------------------------------------------

RUN_ONLY = {"--chaos", "--stagger", "--slow-island", "--slowdown", "--resume", "--verbose", "--out", "--wandb"}
"""Flags of how a run was done (faults, output, logging) that an arm's measuring command leaves out."""
NO_VALUE = {"--resume", "--verbose", "--wandb"}


def applicable(recipe: Recipe, args: argparse.Namespace, arm: Arm) -> Reference | None:
    """The preset's recorded figure of ``arm`` when it holds for this run's setting."""
    ref = recipe.presets[args.preset].reference(arm)
    return ref if ref is not None and ref.applies(recipe, args) else None


def arm_label(arm: Arm, processes: int) -> str:
    return arm.label.format(processes=processes)


def gap(recipe: Recipe, value: float, base: float) -> float:
    """``value`` against ``base``: percent of it for a loss, points of accuracy otherwise."""
    return (value - base) / base * 100 if recipe.metric == "eval_loss" else (value - base) * 100


def format_gap(recipe: Recipe, g: float) -> str:
    return f"{g:+.1f}%" if recipe.metric == "eval_loss" else f"{g:+.2f} points"


def reference_lines(recipe: Recipe, args: argparse.Namespace, value: float, argv: Sequence[str] = ()) -> list[str]:
    """One line per arm (``ARMS``): its recorded figure for this very setting and this run against
    it, or the command that measures it. With both figures, the synchronous line splits this run's
    gap to DDP into the algorithm's own at this size and the rest."""
    processes = args.islands * args.devices
    ddp = applicable(recipe, args, DDP)
    lines = []
    for arm in ARMS:
        label, ref = arm_label(arm, processes), applicable(recipe, args, arm)
        if ref is None:
            lines.append(f"{label}: not measured for this setting; measure it with {arm_command(recipe, args, arm, argv)}")
            continue
        same = ", same preset, steps, batch and lr" if arm is DDP else ""
        head = f"{label}{same}: {recipe.metric} {ref.mean:.4f} +- {ref.std:.4f} over {ref.seeds} seeds"
        if ddp is None or ref is ddp:
            lines.append(f"{head} ({ref.recorded_in}); this run {format_gap(recipe, gap(recipe, value, ref.mean))}")
            continue
        digits = 1 if recipe.metric == "eval_loss" else 2
        own, algorithm = (round(gap(recipe, v, ddp.mean), digits) for v in (value, ref.mean))
        rest = "asynchrony, settings and faults" if args.chaos or args.stagger or args.slowdown > 1 else "asynchrony and settings"
        lines.append(f"{head} ({format_gap(recipe, algorithm)} of DDP; {ref.recorded_in}): of this run's "
                     f"{format_gap(recipe, own)}, {algorithm:+.{digits}f} points are the algorithm at this size, "
                     f"the rest ({own - algorithm:+.{digits}f}) {rest}")
    return lines


def arm_command(recipe: Recipe, args: argparse.Namespace, arm: Arm, argv: Sequence[str]) -> str:
    """This run's command turned into ``arm``'s: the same arguments but the run's own (``RUN_ONLY``)
    and those the arm sets, then the arm's flags, into ``<out>-<arm>``."""
    flags = arm.flags(args)
    dropped = RUN_ONLY | {f.split("=", 1)[0] for f in flags if f.startswith("--")}
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in dropped:
            skip = "=" not in a and name not in NO_VALUE
            continue
        kept.append(a)
    return shlex.join(["python", "-m", recipe.module, *kept, *flags, "--out", f"{args.out}-{arm.name}"])
