"""One Fabric training loop run two ways at equal tokens: as M one-process Decoupled DiLoCo islands
against a synchronizer, or as Fabric's DDP of M ranks. ``benchmarks/fabric.py`` (a tiny Llama) and
``recipes/litgpt_pretrain.py`` (a LitGPT model) are its callers.

A caller is a module run with ``python -m``. It gives a *model builder*, ``build(seed)``: the
model every island and rank starts from, an ``nn.Module`` whose ``forward(input_ids)`` is the
mean next-token loss; the parent runs each arm as fresh processes of the same module with
``--role ROLE`` (:func:`child_arguments`), which hand over to :func:`run_child`. The data are
the text recipes': the Shakespeare works in byte tokens (``recipes.data.text_blocks``), the
eval loss on the held-out works.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_diloco.core.config import RunConfig

SEQ, BATCH, LR = 64, 16, 3e-3
EVAL_SEQUENCES = 512  # the first 512 held-out sequences, in batches of 64
TIMEOUT_S = 1800  # each arm's processes, on a loaded machine
ROLES = ("ddp", "island", "plain", "timed_island")

Builder = Callable[[int], nn.Module]


def text_data() -> tuple[Any, Any]:
    """The training and held-out works, byte tokens in blocks of ``SEQ``."""
    from recipes.data import text_blocks

    train, val, _ = text_blocks(None, "byte", SEQ)
    return train, val


def eval_loss(model: nn.Module, val: Any) -> float:
    model.eval()
    with torch.no_grad():
        losses = [float(model(val[i: i + 64]["input_ids"])) for i in range(0, min(len(val), EVAL_SEQUENCES), 64)]
    return sum(losses) / len(losses)


def train(fabric: Any, build: Builder, seed: int, steps: int, data: Any) -> tuple[nn.Module, list[float], int]:
    """The loop every arm runs: ``steps`` batches of this process's part of ``data``; the module,
    each step's wall time, and the tokens trained on."""
    from torch.utils.data import DataLoader

    module = build(seed)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=LR))
    torch.manual_seed(seed)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH, shuffle=True))
    times: list[float] = []
    tokens = 0
    while len(times) < steps:
        for batch in loader:
            start = time.perf_counter()
            loss = model(batch["input_ids"])
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            times.append(time.perf_counter() - start)
            tokens += batch["input_ids"].numel()
            if len(times) == steps:
                break
    return module, times, tokens


def child_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden arguments a child process gets from :func:`child_command` (besides ``--seed``,
    ``--steps`` and ``--islands``, which the caller's parser has)."""
    parser.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)


def child_command(module: str, role: str, seed: int, steps: int, islands: int, out: Path, extra: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", module, "--role", role, "--seed", str(seed), "--steps", str(steps),
            "--islands", str(islands), "--child-out", str(out), *extra]


def run_child(args: argparse.Namespace, build: Builder, run_config: RunConfig) -> None:
    """One process of an arm: trains, then rank 0 writes ``--child-out``: the median step (the first
    10 steps are warm-up), the tokens of the whole arm (DDP: summed over its ranks), the island's
    metrics, and for DDP the eval loss."""
    from lightning.fabric import Fabric

    from lightning_diloco import DecoupledDiLoCoFabricStrategy

    torch.set_num_threads(1)
    train_data, val = text_data()
    if args.role == "ddp":
        fabric = Fabric(strategy="ddp", accelerator="cpu", devices=args.islands)
    elif args.role == "island":  # DILOCO_* from the parent
        fabric = Fabric(strategy=DecoupledDiLoCoFabricStrategy(run_config=run_config), accelerator="cpu", devices=1)
    elif args.role == "plain":
        fabric = Fabric(accelerator="cpu", devices=1)
    else:  # "timed_island": the paper's schedule against its embedded synchronizer
        fabric = Fabric(strategy=DecoupledDiLoCoFabricStrategy(sync_every=24, num_fragments=24, overlap_steps=2),
                        accelerator="cpu", devices=1)
    fabric.launch()
    module, times, tokens = train(fabric, build, args.seed, args.steps, train_data)
    result: dict[str, Any] = {"median_step_s": statistics.median(times[10:])}
    if isinstance(fabric.strategy, DecoupledDiLoCoFabricStrategy):
        fabric.strategy.teardown()
        result["diloco"] = fabric.strategy.metrics()
    result["tokens"] = int(fabric.all_reduce(torch.tensor(float(tokens)), reduce_op="sum")) if args.role == "ddp" else tokens
    if args.role == "ddp" and fabric.global_rank == 0:
        result["eval_loss"] = eval_loss(module, val)
    if fabric.global_rank == 0:
        Path(args.child_out).write_text(json.dumps(result))


def run_process(cmd: list[str], out: Path) -> dict:
    """Runs one arm's process (tree) to its end, bounded; what it wrote to ``out``."""
    from lightning_diloco.launch.supervisor import clean_environment
    from recipes.processes import run_tree

    # without the parent's rank variables: a LOCAL_RANK left by an earlier in-process Lightning run
    # (the test suite's) made Fabric's DDP arm take its ranks as launched outside, start no second
    # rank, and wait for it until killed
    done = run_tree(cmd, timeout=TIMEOUT_S, env=clean_environment({"OMP_NUM_THREADS": "1"}))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: exit {done.returncode}")
    return json.loads(out.read_text())


def run_islands(module: str, build: Builder, run_config: RunConfig, seed: int, steps: int, islands: int, folder: Path,
                extra: Sequence[str] = ()) -> dict:
    """M one-process islands (fresh processes of ``module``) against a synchronizer in this process:
    the global model's eval loss, each island's result, the rounds' health."""
    import lightning_diloco
    from lightning_diloco.launch.report import rounds_health
    from lightning_diloco.launch.supervisor import clean_environment
    from lightning_diloco.synchronizer.server import SynchronizerServer
    from lightning_diloco.synchronizer.service import Synchronizer

    server = SynchronizerServer(Synchronizer(run_config)).start()
    try:
        outs = [folder / f"island{i}.json" for i in range(islands)]
        env = {"OMP_NUM_THREADS": "1", "DILOCO_SYNCHRONIZER": server.address, "DILOCO_NUM_ISLANDS": str(islands)}
        procs = [subprocess.Popen(child_command(module, "island", seed, steps, islands, out, extra), start_new_session=True,
                                  env=clean_environment({**env, "DILOCO_ISLAND": str(i)})) for i, out in enumerate(outs)]
        try:
            for proc in procs:
                if proc.wait(timeout=TIMEOUT_S) != 0:
                    raise RuntimeError(f"an island failed: exit {proc.returncode}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        model = build(seed)
        lightning_diloco.load_global_model(model, synchronizer=server.address)
        health = rounds_health(server.service.status())
    finally:
        server.stop(grace=0)
    return {"eval_loss": eval_loss(model, text_data()[1]), "islands": [json.loads(out.read_text()) for out in outs],
            "rounds_health": health}
