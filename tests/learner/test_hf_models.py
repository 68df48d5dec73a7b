"""Hugging Face causal LMs (built offline from tiny configs) train as learner islands."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_diloco  # noqa: F401
from lightning_diloco import DecoupledDiLoCoStrategy
from lightning_diloco.core.fragments import EMBEDDING, tensor_specs
from tests.learner.models import trainer

VOCAB = 32


class CountingSequences(Dataset):
    """Sequences that count upward modulo the vocabulary: learnable in a few dozen steps."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        ids = (torch.arange(16) + i) % VOCAB
        return {"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long)}


class CausalLM(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        out = self.model(**batch, labels=batch["input_ids"])
        self.losses.append(float(out.loss.detach()))
        return out.loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _dense():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _moe():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=32, output_router_logits=True))


@pytest.mark.parametrize("build", [_dense, _moe], ids=["llama", "mixtral-moe"])
def test_hugging_face_causal_lm_fits_as_an_island(build):
    module = CausalLM(build())
    roles = {s.name: s.role for s in tensor_specs(module)}
    assert roles["model.model.embed_tokens.weight"] == EMBEDDING
    if build is _moe:
        assert any(name.endswith("experts.gate_up_proj") for name in roles)  # fused 3-D experts travel whole
    strategy = DecoupledDiLoCoStrategy(sync_every=8, num_fragments=8, overlap_steps=1, outer_lr=0.7, outer_momentum=0.5)
    trainer(strategy, max_epochs=3).fit(module, DataLoader(CountingSequences(), batch_size=16, shuffle=True))
    first, last = sum(module.losses[:4]) / 4, sum(module.losses[-4:]) / 4
    assert last < 0.6 * first, (first, last)
    m = strategy.final_metrics
    assert m["diloco/syncs_applied"] >= 30 and m["diloco/syncs_failed"] == 0


def test_a_compiled_hugging_face_model_in_bf16_true_fits_under_the_plain_models_names():
    """``self.model = torch.compile(model)`` (names gain ``_orig_mod.``) with ``precision="bf16-true"``:
    the island's layout is the plain fp32 model's, so it would join a run of plain islands."""
    plain = tensor_specs(CausalLM(_dense()))
    module = CausalLM(torch.compile(_dense(), backend="eager"))  # eager: inductor took 15 s for a 2-layer MLP on 2 loaded cores
    assert tensor_specs(module) == plain and "model._orig_mod.model.embed_tokens.weight" in dict(module.named_parameters())
    strategy = DecoupledDiLoCoStrategy(sync_every=8, num_fragments=8, overlap_steps=1, outer_lr=0.7, outer_momentum=0.5)
    trainer(strategy, max_epochs=3, precision="bf16-true").fit(module, DataLoader(CountingSequences(), batch_size=16, shuffle=True))
    assert next(module.parameters()).dtype == torch.bfloat16
    first, last = sum(module.losses[:4]) / 4, sum(module.losses[-4:]) / 4
    assert last < 0.6 * first, (first, last)
    m = strategy.final_metrics
    assert m["diloco/syncs_applied"] >= 30 and m["diloco/syncs_failed"] == 0
