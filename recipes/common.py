"""What every recipe shares: arguments and presets, launching M islands (or M DDP ranks), training
one island, evaluation curves, CSV and W&B logging (the summary and the result files compare.py
reads: summary.py).

A recipe run started by a user is the *launcher*: it starts ``lightning-diloco run`` machinery
(a synchronizer and M island processes, or one M-process DDP job) whose processes run the same
recipe command again; those see ``DILOCO_STRATEGY`` in their environment and train.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_diloco.core import presets
from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.protocol import SynchronizerStatus
from lightning_diloco.core.settings import (
    add_setting_arguments,
    changed_settings,
    config_with,
    given_settings,
    setting_flags,
    value_of,
)
from lightning_diloco.learner.collective import leave_process_group

PROGRESS_EVERY_S = 5.0  # a progress line this often; each process's output in OUT/run/*.log (--verbose: all of it)


@dataclass
class Preset:
    """A size: model and data shape, optimisation, and the outer settings chosen for it."""

    model: dict[str, Any]
    batch: int
    steps: int
    lr: float
    run_config: RunConfig = field(default_factory=presets.paper)
    """Decoupled DiLoCo's settings for this size; the command line's win."""
    references: tuple[Reference, ...] = ()
    """The figures recorded at this preset's steps, batch and lr for the arms a run is put beside."""
    note: str = ""

    def reference(self, arm: Arm) -> Reference | None:
        return next((r for r in self.references if r.arm is arm), None)


@dataclass(frozen=True)
class Arm:
    """What a Decoupled DiLoCo run is put beside: its name in the summary (``{processes}``: M x
    devices), the flags that turn the run's command into it, and whether a figure recorded at a
    preset's settings needs the run's H and P to be the preset's as well."""

    name: str
    label: str
    flags: Callable[[argparse.Namespace], list[str]]
    same_schedule: bool = False


def synchronous_settings(islands: int) -> dict[str, Any]:
    """Synchronous DiLoCo: every island in every round (quorum M), the apply at the send (no
    overlap, so the training loop waits for the round), plain averaging of exact (fp32) fragments."""
    return {"overlap_steps": 0, "min_quorum": islands, "outer_lr": 1.0, "outer_momentum": 0.0, "apply": "overwrite",
            "uplink_codec": "fp32", "downlink_codec": "fp32"}


DDP = Arm("ddp", "DDP, {processes} processes", lambda args: ["--strategy", "ddp"])
SYNCHRONOUS = Arm("synchronous", "synchronous DiLoCo (same H, P, M; blocking)",
                  lambda args: setting_flags(synchronous_settings(args.islands)), same_schedule=True)
ARMS = (DDP, SYNCHRONOUS)
"""The arms a run's summary names, in its order: the gap to DDP, then how much of it the algorithm
itself has at this size (synchronous DiLoCo at the same H, P and M) and how much is asynchrony."""

REFERENCE_CURVES = Path(__file__).parent / "references"


@dataclass(frozen=True)
class Reference:
    """An arm's recorded figure at a preset's own model, steps, batch and lr on ``processes``
    processes: the mean and standard deviation of its final metric over ``seeds`` seeds, where
    that is written down, and optionally its eval curve (``curve``: a CSV in recipes/references/,
    mean and std over seeds of the metric against tokens, its header saying how it was measured)."""

    arm: Arm
    processes: int
    mean: float
    std: float
    seeds: int = 3
    recorded_in: str = "README's results table"
    curve: str | None = None

    def applies(self, recipe: Recipe, args: argparse.Namespace) -> bool:
        """Whether ``args`` train what the reference trained: the preset as it is, on as many
        processes (and for a synchronous reference, at the preset's H and P)."""
        preset = recipe.presets[args.preset]
        same_model = all(getattr(args, k, v) == v for k, v in preset.model.items()) and getattr(args, "dataset", None) is None
        same_schedule = not self.arm.same_schedule or all(
            value_of(config_with(given_settings(args)), name) == value_of(preset.run_config, name)
            for name in ("sync_every", "num_fragments"))
        return (args.islands * args.devices == self.processes and (args.steps, args.batch, args.lr) ==
                (preset.steps, preset.batch, preset.lr) and same_model and same_schedule)

    def curve_points(self) -> list[dict[str, float]]:
        """The recorded curve's rows (``tokens``, the metric, its ``std``); none without a curve."""
        if self.curve is None:
            return []
        with open(REFERENCE_CURVES / self.curve) as f:
            return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(line for line in f if not line.startswith("#"))]


@dataclass
class Recipe:
    name: str
    module: str  # python -m target
    presets: dict[str, Preset]
    metric: str  # the headline figure: eval_loss (lower is better) or accuracy
    add_arguments: Callable[[argparse.ArgumentParser], None]
    build_module: Callable[[argparse.Namespace], Any]
    datasets: Callable[[argparse.Namespace], tuple[Any, Any]]
    tokens_per_sample: Callable[[argparse.Namespace], int]


def build_parser(recipe: Recipe, description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=["decoupled_diloco", "decoupled_diloco_fsdp", "ddp"], default="decoupled_diloco",
                   help="decoupled_diloco_fsdp: islands whose processes shard the model with FSDP2 (default %(default)s)")
    p.add_argument("--islands", type=int, default=4, help="M: islands, or DDP processes for --strategy ddp (default %(default)s)")
    p.add_argument("--devices", type=int, default=1, help="processes inside each island: DDP, or FSDP2 (default %(default)s)")
    p.add_argument("--accelerator", default="cpu", help="Lightning accelerator: cpu, gpu, auto (default %(default)s)")
    p.add_argument("--preset", choices=sorted(recipe.presets), default=next(iter(recipe.presets)),
                   help="model, data and run settings sized for a machine (default %(default)s)")
    p.add_argument("--steps", type=int, help="inner steps per island (default: the preset's)")
    p.add_argument("--batch", type=int, help="samples per process and step (default: the preset's)")
    p.add_argument("--lr", type=float, help="inner AdamW peak learning rate (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="model init and, unless --data-seed, the data's shuffle (default %(default)s)")
    p.add_argument("--eval-every", type=int, help="steps between evaluation points of the curve (default: steps / 10)")
    p.add_argument("--eval-batches", type=int, default=8, help="batches per curve point (default %(default)s)")
    p.add_argument("--final-eval-batches", type=int, default=64, help="batches of the final evaluation (default %(default)s)")
    p.add_argument("--out", default=None, help="results, curves and CSV logs (default runs/<recipe>-<preset>-<strategy>); an "
                   "earlier run there is moved aside to OUT.prev-<time>")
    p.add_argument("--resume", action="store_true", help="continue the run in --out (its synchronizer checkpoint; islands "
                   "resume from their last checkpoint when one was saved) instead of moving it aside")
    p.add_argument("--verbose", action="store_true", help="print every line the islands and the synchronizer print "
                   f"(default: a progress line every {PROGRESS_EVERY_S:g} s, their output in OUT/run/*.log)")
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases (offline unless logged in)")
    p.add_argument("--wandb-project", default="lightning-diloco")
    p.add_argument("--wandb-group", default=None, help="W&B group (default: the output folder's name)")
    p.add_argument("--chaos", help="fault schedule for the launcher, e.g. 'kill 1 at step 300'; islands then "
                   "checkpoint every steps / 20 and a restarted one resumes from its last checkpoint")
    p.add_argument("--stagger", type=float, default=0.0, help="start island i i x this many seconds after island 0")
    p.add_argument("--slow-island", type=int, default=-1, help="island (DDP: rank) whose steps take --slowdown x as long")
    p.add_argument("--slowdown", type=float, default=1.0, help="step-time factor of --slow-island (default %(default)s)")
    g = p.add_argument_group("Decoupled DiLoCo run settings (default: the preset's, else the library's)")
    add_setting_arguments(g, show_defaults=False)
    p.add_argument("--run-t0", type=float, help=argparse.SUPPRESS)  # set by the launcher for its processes
    recipe.add_arguments(p)
    return p


def resolve(recipe: Recipe, args: argparse.Namespace) -> argparse.Namespace:
    preset = recipe.presets[args.preset]
    for name in ("steps", "batch", "lr"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    for name, value in changed_settings(preset.run_config).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for name, value in preset.model.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.data_seed is None:  # island i shuffles as DDP's rank i of a run seeded --seed does
        args.data_seed = args.seed
    args.eval_every = args.eval_every or max(1, args.steps // 10)
    args.out = args.out or f"runs/{recipe.name}-{args.preset}-{args.strategy}"
    if args.wandb:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise SystemExit("--wandb needs Weights & Biases: pip install 'lightning-diloco[wandb]'")
    if args.islands < 1 or args.devices < 1:
        raise SystemExit(f"--islands={args.islands} and --devices={args.devices} must be >= 1")
    if args.strategy != "ddp" and (args.min_quorum or 1) > args.islands:
        raise SystemExit(f"--min-quorum={args.min_quorum} exceeds --islands={args.islands}: no round could ever close")
    if args.chaos:  # now, before an earlier run in --out is moved aside for one that cannot start
        from lightning_diloco.launch.chaos import parse_schedule

        try:
            parse_schedule(args.chaos, num_islands=args.islands)
        except (ValueError, OSError) as err:
            raise SystemExit(f"--chaos: {err}") from None
    return args


def main(recipe: Recipe, argv: list[str] | None, description: str | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = resolve(recipe, build_parser(recipe, description).parse_args(argv))
    if os.environ.get("DILOCO_STRATEGY"):
        code = train(recipe, args)
        leave_process_group()  # every rank together: a lone exit was seen to abort its peer under load
        return code
    return launch(recipe, args, argv)


# ---- the launcher -----------------------------------------------------------------------------------


# What a recipe run writes into its --out (compare.py adds output.log and command.txt).
RUN_FILES = ("run", "result*.json", "curve-*.csv", "*-curve.png", "*.tmp", "logs", "run-report.json", "wandb", "output.log", "command.txt")


def launch(recipe: Recipe, args: argparse.Namespace, argv: list[str]) -> int:
    from lightning_diloco.launch.run import RunOptions, run
    from lightning_diloco.launch.workdir import FolderInUse, set_aside
    from recipes.summary import format_summary, plot_curve, summarize

    out = Path(args.out)
    try:
        note = set_aside(out, resume=args.resume, run_files=RUN_FILES, flag="--out")
    except FolderInUse as err:
        raise SystemExit(f"{recipe.module}: {err}") from None
    if note:
        print(note, end="", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("result*.json"), *out.glob("curve-*.csv")]:  # a continued run's results are its own
        stale.unlink()
    t0 = time.time()
    command = [sys.executable, "-m", recipe.module, *argv, "--out", str(out), "--run-t0", repr(t0)]
    ddp = args.strategy == "ddp"
    options = RunOptions(
        islands=args.islands, devices_per_island=args.devices, workdir=str(out / "run"), report=str(out / "run-report.json"),
        restart_backoff=0.5, baseline="ddp" if ddp else None, chaos=args.chaos, stagger=args.stagger, resume=args.resume,
        run_config=None if ddp else config_with(given_settings(args)),  # the islands' strategy gets the same settings
        progress_every=0.0 if args.verbose else PROGRESS_EVERY_S,
    )
    observer = SynchronizerObserver(args, out) if not ddp else None
    code = run(options, command, observers=[observer] if observer else [])
    wall = time.time() - t0
    if observer:
        observer.close()
    summary = summarize(recipe, args, out, wall, observer.last if observer else None)
    try:
        plot = plot_curve(recipe, args, out, summary)
    except Exception as err:  # a missing plotting library costs the picture, not the run's results
        print(f"{recipe.module}: no eval-curve picture ({type(err).__name__}: {err})", flush=True)
        plot = None
    summary["plot"] = str(plot) if plot else None
    (out / "result.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(recipe, args, summary, argv), flush=True)
    return code


class SynchronizerObserver:
    """Keeps the synchronizer's last status, and logs its metrics to W&B as their own run."""

    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.last: SynchronizerStatus | None = None
        self.run = start_wandb(args, out, name=f"{args.strategy}-synchronizer") if args.wandb else None
        self._next_log = 0.0

    def __call__(self, status: SynchronizerStatus) -> None:
        self.last = status
        if self.run is not None and time.monotonic() >= self._next_log:
            self._next_log = time.monotonic() + 2.0
            self.run.log({"synchronizer/outer_steps": status.outer_steps, "synchronizer/bytes_in": status.bytes_in,
                          "synchronizer/bytes_out": status.bytes_out, "synchronizer/live_islands": len(status.live_islands),
                          "synchronizer/accepted": sum(status.accepted.values()),
                          "synchronizer/refused": sum(status.refused.values())})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


# ---- one island (or one DDP job) ------------------------------------------------------------------


@contextmanager
def global_weights(trainer):
    """The island's current global model in place of its local weights (a no-op under DDP)."""
    learner = getattr(trainer.strategy, "learner", None)
    if learner is None:
        yield
        return
    with learner.global_weights():
        yield


def evenly_spaced(dataset, n: int):
    import torch

    if n >= len(dataset):
        return dataset
    return torch.utils.data.Subset(dataset, torch.linspace(0, len(dataset) - 1, n).long().tolist())


def evaluate(module, loader, device) -> dict[str, float]:
    """The recipe module's eval metrics (torchmetrics) over ``loader``; training mode after."""
    import torch

    module.eval()
    metrics = module.eval_metrics()
    with torch.no_grad():
        for batch in loader:
            module.eval_update(metrics, module.transfer_batch_to_device(batch, device, 0))
    module.train()
    return {name: float(metric.compute()) for name, metric in metrics.items()}


def train(recipe: Recipe, args: argparse.Namespace) -> int:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    import lightning_diloco
    from lightning_diloco.launch.progress import ProgressFile

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    strategy_name = os.environ["DILOCO_STRATEGY"]
    devices = int(os.environ.get("DILOCO_DEVICES", "1"))
    island = int(os.environ.get("DILOCO_ISLAND", "0"))
    unit = "ddp" if strategy_name == "ddp" else f"island{island}"
    out = Path(args.out)
    t0 = args.run_t0 or time.time()
    pl.seed_everything(args.seed + (0 if strategy_name == "ddp" else island), verbose=False)
    # a sharded model's forward needs every rank: they all evaluate, rank 0 records
    every_rank_evaluates = args.strategy == "decoupled_diloco_fsdp"
    train_set, val_set = recipe.datasets(args)
    module = recipe.build_module(args)  # same initial weights everywhere: the seed is fixed inside
    val_curve = DataLoader(evenly_spaced(val_set, args.eval_batches * args.batch), batch_size=args.batch)
    val_final = DataLoader(evenly_spaced(val_set, args.final_eval_batches * args.batch), batch_size=args.batch)
    tokens_per_step = recipe.tokens_per_sample(args) * args.batch * args.islands * args.devices

    class Curve(Callback):
        """Eval metric against global tokens and wall-clock, on the global model, every N steps."""

        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            if (trainer.global_rank != 0 and not every_rank_evaluates) or (step % args.eval_every and step != args.steps):
                return
            with global_weights(trainer):
                metrics = evaluate(pl_module, val_curve, pl_module.device)
            if trainer.global_rank != 0:
                return
            row = {"step": step, "tokens": step * tokens_per_step, "wall_s": round(time.time() - t0, 3), **metrics}
            self.rows.append(row)
            for logger in trainer.loggers:
                logger.log_metrics({f"eval/{k}": v for k, v in metrics.items()}, step=step)

    class Straggler(Callback):
        """Makes one unit's steps take ``--slowdown`` x as long (a slower chip, or a shared host):
        island ``--slow-island``, or that rank of the DDP job."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            unit_index = trainer.global_rank if strategy_name == "ddp" else island
            if unit_index == args.slow_island:
                time.sleep((args.slowdown - 1.0) * (time.perf_counter() - self.started))

    loggers = [CSVLogger(out / "logs", name=unit, version=f"incarnation-{time.time_ns()}")]
    if args.wandb:
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(**wandb_kwargs(args, out, name=f"{strategy_name}-{unit}")))
    curve = Curve()
    callbacks = [ProgressFile(), curve] + ([Straggler()] if args.slowdown > 1.0 else [])
    ckpt_path = None
    ckpt_dir = os.environ.get("DILOCO_CHECKPOINT_DIR")
    if args.chaos and ckpt_dir:  # checkpoint-restart: the DDP baseline's, and a killed island's resume
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=max(1, args.steps // 20)))
    last = Path(ckpt_dir) / "last.ckpt" if ckpt_dir else None
    if last is not None and last.exists() and (args.chaos or args.resume):
        ckpt_path = str(last)
    if strategy_name == "ddp":
        strategy: Any = "ddp"
    elif args.strategy == "decoupled_diloco_fsdp":  # the module's configure_model shards it
        strategy = lightning_diloco.DecoupledDiLoCoFSDPStrategy(**given_settings(args))
    else:
        strategy = lightning_diloco.DecoupledDiLoCoStrategy(**given_settings(args))
    trainer = pl.Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=devices, max_steps=args.steps, logger=loggers,
        callbacks=callbacks, enable_checkpointing=bool(args.chaos and ckpt_dir),
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        log_every_n_steps=max(1, args.eval_every // 4), use_distributed_sampler=True,
    )
    trainer.fit(module, DataLoader(train_set, batch_size=args.batch, shuffle=True, drop_last=True), ckpt_path=ckpt_path)
    if trainer.global_rank != 0 and not every_rank_evaluates:
        return 0
    # what rank 0 holds of the parameters: all of them, or its FSDP2 shards (before an evaluation's
    # forward gathers the root module's)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters())
    final = evaluate(module, val_final, module.device)  # the global model: fit ended by loading it
    if trainer.global_rank != 0:
        return 0
    for logger in trainer.loggers:
        logger.log_metrics({f"final/{k}": v for k, v in final.items()}, step=trainer.global_step)
        logger.finalize("success")
    diloco = dict(getattr(trainer.strategy, "final_metrics", {}))
    result = {
        "unit": unit, "steps": trainer.global_step, "final": final, "params": sum(p.numel() for p in module.parameters()),
        "params_on_rank0": held,
        "tokens": trainer.global_step * recipe.tokens_per_sample(args) * args.batch * devices,
        "finished_at": time.time() - t0, "diloco": diloco,
    }
    write_json(out / f"result-{unit}.json", result)
    if curve.rows:  # this incarnation's points (a restarted island starts its curve again)
        with open(out / f"curve-{unit}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(curve.rows[0]))
            writer.writeheader()
            writer.writerows(curve.rows)
    return 0


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


# ---- Weights & Biases ---------------------------------------------------------------------------------


def wandb_kwargs(args: argparse.Namespace, out: Path, name: str) -> dict[str, Any]:
    """One W&B run per island (and one for the synchronizer), grouped by the output folder.

    Offline unless the user is logged in (``WANDB_API_KEY`` or ``wandb login``): the runs stay in
    ``OUT/wandb`` and ``wandb sync OUT/wandb/offline-run-*`` uploads them later.
    """
    logged_in = bool(os.environ.get("WANDB_API_KEY")) or _netrc_has_wandb()
    return {
        "project": args.wandb_project, "group": args.wandb_group or Path(args.out).resolve().name, "name": name,
        "save_dir": str(out), "offline": not logged_in, "config": {k: v for k, v in vars(args).items() if k != "run_t0"},
    }


def _netrc_has_wandb() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def start_wandb(args: argparse.Namespace, out: Path, name: str):
    import wandb

    kw = wandb_kwargs(args, out, name)
    return wandb.init(project=kw["project"], group=kw["group"], name=name, dir=kw["save_dir"],
                      mode="offline" if kw["offline"] else "online", config=kw["config"], reinit="create_new")


def cosine_with_warmup(steps: int, warmup_fraction: float = 0.05, floor: float = 0.1) -> Callable[[int], float]:
    """The inner learning-rate multiplier: linear warm-up, then cosine decay to ``floor``."""
    warmup = max(1, int(steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
