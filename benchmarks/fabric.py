"""A Fabric loop as Decoupled DiLoCo islands against the same loop under Fabric's DDP.

    python -m benchmarks.fabric [--seeds 0 1 2] [--steps 200] [--repeats 3] [--timing-steps 120]

Quality: a tiny Llama (built from a config) on the Shakespeare works (byte tokens, the recipes'
data), trained by the same Fabric loop either as 2 one-process islands
(``DecoupledDiLoCoFabricStrategy``, the CPU recipes' run settings: ``presets.small_model()``)
against one synchronizer, or as Fabric's DDP of 2 ranks: equal tokens (each island or rank takes
``--steps`` batches of its half of the data). The figure is the eval loss on the held-out works
of the synchronizer's global model (``load_global_model``) against DDP's model, per seed.

Step time: a one-process island with its embedded synchronizer at the paper's schedule (P = H =
24, tau = 2, int4) against plain Fabric on one device, both on one torch thread, in fresh
processes alternating ``--repeats`` times; the ratio of the medians of each run's median step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.processes import run_tree

HIDDEN, LAYERS, SEQ, BATCH = 64, 2, 64, 16


class LM(nn.Module):
    def __init__(self, seed: int, vocab: int = 256) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=HIDDEN * 11 // 4, num_hidden_layers=LAYERS,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
        ))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def _data():
    from recipes.data import text_blocks

    train, val, _ = text_blocks(None, "byte", SEQ)
    return train, val


def eval_loss(model: nn.Module, val) -> float:
    model.eval()
    with torch.no_grad():
        losses = [float(model(val[i: i + 64]["input_ids"])) for i in range(0, min(len(val), 512), 64)]
    return sum(losses) / len(losses)


def train(fabric, seed: int, steps: int, data) -> tuple[nn.Module, list[float]]:
    """The loop every arm runs: ``steps`` batches, each step's wall time."""
    from torch.utils.data import DataLoader

    module = LM(seed)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=3e-3))
    torch.manual_seed(seed)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=BATCH, shuffle=True))
    times: list[float] = []
    while len(times) < steps:
        for batch in loader:
            start = time.perf_counter()
            loss = model(batch["input_ids"])
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            times.append(time.perf_counter() - start)
            if len(times) == steps:
                break
    return module, times


def child(args: argparse.Namespace) -> None:
    from lightning.fabric import Fabric

    from lightning_diloco import DecoupledDiLoCoFabricStrategy
    from lightning_diloco.core.presets import small_model

    torch.set_num_threads(1)
    train_data, val = _data()
    if args.role == "ddp":
        fabric = Fabric(strategy="ddp", accelerator="cpu", devices=2)
    elif args.role == "island":  # DILOCO_* from the parent
        fabric = Fabric(strategy=DecoupledDiLoCoFabricStrategy(run_config=small_model()), accelerator="cpu", devices=1)
    elif args.role == "plain":
        fabric = Fabric(accelerator="cpu", devices=1)
    else:  # "timed_island": the paper's schedule against its embedded synchronizer
        fabric = Fabric(strategy=DecoupledDiLoCoFabricStrategy(sync_every=24, num_fragments=24, overlap_steps=2),
                        accelerator="cpu", devices=1)
    fabric.launch()
    module, times = train(fabric, args.seed, args.steps, train_data)
    if isinstance(fabric.strategy, DecoupledDiLoCoFabricStrategy):
        fabric.strategy.teardown()
    result = {"median_step_s": statistics.median(times[10:])}
    if args.role == "ddp" and fabric.global_rank == 0:
        result["eval_loss"] = eval_loss(module, val)
    if fabric.global_rank == 0:
        Path(args.out).write_text(json.dumps(result))


def _child_cmd(role: str, seed: int, steps: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.fabric", "--role", role, "--seed", str(seed), "--steps", str(steps),
            "--out", str(out)]


def _run(cmd: list[str], env: dict[str, str]) -> None:
    from lightning_diloco.launch.supervisor import clean_environment

    # without the parent's rank variables: a LOCAL_RANK left by an earlier in-process Lightning run
    # (the test suite's) made Fabric's DDP arm take its ranks as launched outside, start no second
    # rank, and wait for it until killed
    done = run_tree(cmd, timeout=1800, env=clean_environment(env))
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: exit {done.returncode}")


def islands_eval_loss(seed: int, steps: int, folder: Path) -> float:
    import lightning_diloco
    from lightning_diloco.core.presets import small_model
    from lightning_diloco.launch.supervisor import clean_environment
    from lightning_diloco.synchronizer.server import SynchronizerServer
    from lightning_diloco.synchronizer.service import Synchronizer

    server = SynchronizerServer(Synchronizer(small_model())).start()
    try:
        procs = [subprocess.Popen(_child_cmd("island", seed, steps, folder / f"island{i}.json"), start_new_session=True,
                                  env=clean_environment({"OMP_NUM_THREADS": "1", "DILOCO_SYNCHRONIZER": server.address,
                                                         "DILOCO_ISLAND": str(i), "DILOCO_NUM_ISLANDS": "2"}))
                 for i in range(2)]
        for proc in procs:
            if proc.wait(timeout=1800) != 0:
                raise RuntimeError(f"an island failed: exit {proc.returncode}")
        module = LM(seed)
        lightning_diloco.load_global_model(module, synchronizer=server.address)
    finally:
        server.stop(grace=0)
    return eval_loss(module, _data()[1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="seeds of the quality runs (none: skip them)")
    parser.add_argument("--steps", type=int, default=200, help="batches per island and per DDP rank")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the two step-time arms (0: skip them)")
    parser.add_argument("--timing-steps", type=int, default=120, help="steps of each step-time run (the first 10 are warm-up)")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        child(args)
        return {}
    env = {"OMP_NUM_THREADS": "1"}
    results: dict = {"eval_loss": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for seed in args.seeds:
            out = folder / f"ddp{seed}.json"
            _run(_child_cmd("ddp", seed, args.steps, out), env)
            ddp = json.loads(out.read_text())["eval_loss"]
            islands = islands_eval_loss(seed, args.steps, folder)
            results["eval_loss"][seed] = {"islands": islands, "ddp": ddp}
            print(f"seed {seed}: eval loss islands {islands:.4f}, DDP {ddp:.4f}, gap {100 * (islands / ddp - 1):+.1f}%", flush=True)
        medians: dict[str, list[float]] = {"plain": [], "timed_island": []}
        for _ in range(args.repeats):
            for role in medians:
                out = folder / f"{role}.json"
                _run(_child_cmd(role, 0, args.timing_steps, out), env)
                medians[role].append(json.loads(out.read_text())["median_step_s"])
    if args.repeats:
        plain, island = statistics.median(medians["plain"]), statistics.median(medians["timed_island"])
        results.update(step_s=medians, ratio=island / plain, ratio_of_best=min(medians["timed_island"]) / min(medians["plain"]))
        print(f"step time: plain Fabric {1000 * plain:.1f} ms, one-process island {1000 * island:.1f} ms, ratio "
              f"{results['ratio']:.3f}; best runs' ratio {results['ratio_of_best']:.3f} (each run's median, ms: "
              + ", ".join(f"{role} {[round(1000 * t, 1) for t in times]}" for role, times in medians.items()) + ")")
    return results


if __name__ == "__main__":
    main()
