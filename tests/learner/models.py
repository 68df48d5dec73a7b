"""Tiny LightningModules and data for strategy tests (CPU, seconds)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n=256, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    y = x @ w + 0.01 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class TinyRegressor(pl.LightningModule):
    def __init__(self, dim=8, hidden=16, lr=1e-2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.lr = lr
        self.losses: list[float] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)


class ShardedTinyRegressor(TinyRegressor):
    """TinyRegressor written for Lightning's ModelParallelStrategy: FSDP2 per layer and on the root."""

    def configure_model(self):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.net, FSDPModule):  # a second fit on the same module
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


class CheckpointedRegressor(TinyRegressor):
    """Activation checkpointing by a plain ``torch.utils.checkpoint`` call: no module, no name change."""

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.net, x, use_reentrant=False)


WRAPPINGS = ("plain", "compiled", "checkpoint-wrapped", "checkpointed")


def wrapped_regressor(wrapping: str, seed: int = 0) -> TinyRegressor:
    """TinyRegressor as users write it, wrapped inside the LightningModule: ``compiled``
    (``self.net = torch.compile(self.net)``: names gain ``_orig_mod.``; the eager backend, as
    inductor's compile takes 15 s on a loaded 2-core machine and only the names matter here),
    ``checkpoint-wrapped`` (each Linear in torch's ``checkpoint_wrapper``: names gain
    ``_checkpoint_wrapped_module.``) or ``checkpointed`` (a ``torch.utils.checkpoint`` call)."""
    if wrapping not in WRAPPINGS:
        raise ValueError(f"wrapping {wrapping!r}: expected one of {WRAPPINGS}")
    model = (CheckpointedRegressor if wrapping == "checkpointed" else TinyRegressor)(seed=seed)
    if wrapping == "compiled":
        model.net = torch.compile(model.net, backend="eager")
    elif wrapping == "checkpoint-wrapped":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, layer in enumerate(model.net):
            if isinstance(layer, nn.Linear):
                model.net[i] = checkpoint_wrapper(layer)
    return model


def loader(dataset, batch_size=16, shuffle=False):
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)


def trainer(strategy, **kwargs):
    defaults = dict(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, **defaults)
