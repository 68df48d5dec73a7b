"""A Fabric loop as Decoupled DiLoCo islands against the same loop under Fabric's DDP.

    python -m benchmarks.fabric [--seeds 0 1 2] [--steps 200] [--repeats 3] [--timing-steps 120]

Quality: a tiny Llama (built from a config) on the Shakespeare works (byte tokens, the recipes'
data), trained by the same Fabric loop either as 2 one-process islands
(``DecoupledDiLoCoFabricStrategy``, the library's defaults at P = 8: ``presets.small_model()``,
as measured in benchmarks/RESULTS.md; the text recipes have used ``small_text_model()`` since)
against one synchronizer, or as Fabric's DDP of 2 ranks: equal tokens (each island or rank takes
``--steps`` batches of its half of the data). The figure is the eval loss on the held-out works
of the synchronizer's global model (``load_global_model``) against DDP's model, per seed.

The loop, its data and the arms' processes are ``recipes/fabric_arms.py``'s (shared with the
LitGPT recipe).

Step time: a one-process island with its embedded synchronizer at the paper's schedule (P = H =
24, tau = 2, int4) against plain Fabric on one device, both on one torch thread, in fresh
processes alternating ``--repeats`` times; the ratio of the medians of each run's median step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from torch import nn

from recipes import fabric_arms

HIDDEN, LAYERS = 64, 2
MODULE = "benchmarks.fabric"


class LM(nn.Module):
    def __init__(self, seed: int, vocab: int = 256) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=HIDDEN * 11 // 4, num_hidden_layers=LAYERS,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=fabric_arms.SEQ,
        ))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=input_ids).loss


def _run_config():
    from lightning_diloco.core.presets import small_model

    return small_model()


def _arm(role: str, seed: int, steps: int, folder: Path) -> dict:
    out = folder / f"{role}{seed}.json"
    return fabric_arms.run_process(fabric_arms.child_command(MODULE, role, seed, steps, 2, out), out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="seeds of the quality runs (none: skip them)")
    parser.add_argument("--steps", type=int, default=200, help="batches per island and per DDP rank")
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the two step-time arms (0: skip them)")
    parser.add_argument("--timing-steps", type=int, default=120, help="steps of each step-time run (the first 10 are warm-up)")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--islands", type=int, default=2, help=argparse.SUPPRESS)
    fabric_arms.child_arguments(parser)
    args = parser.parse_args(argv)
    if args.role:
        fabric_arms.run_child(args, LM, _run_config())
        return {}
    results: dict = {"eval_loss": {}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for seed in args.seeds:
            ddp = _arm("ddp", seed, args.steps, folder)["eval_loss"]
            islands = fabric_arms.run_islands(MODULE, LM, _run_config(), seed, args.steps, 2, folder)["eval_loss"]
            results["eval_loss"][seed] = {"islands": islands, "ddp": ddp}
            print(f"seed {seed}: eval loss islands {islands:.4f}, DDP {ddp:.4f}, gap {100 * (islands / ddp - 1):+.1f}%", flush=True)
        medians: dict[str, list[float]] = {"plain": [], "timed_island": []}
        for _ in range(args.repeats):
            for role in medians:
                medians[role].append(_arm(role, 0, args.timing_steps, folder)["median_step_s"])
    if args.repeats:
        plain, island = statistics.median(medians["plain"]), statistics.median(medians["timed_island"])
        results.update(step_s=medians, ratio=island / plain, ratio_of_best=min(medians["timed_island"]) / min(medians["plain"]))
        print(f"step time: plain Fabric {1000 * plain:.1f} ms, one-process island {1000 * island:.1f} ms, ratio "
              f"{results['ratio']:.3f}; best runs' ratio {results['ratio_of_best']:.3f} (each run's median, ms: "
              + ", ".join(f"{role} {[round(1000 * t, 1) for t in times]}" for role, times in medians.items()) + ")")
    return results


if __name__ == "__main__":
    main()
