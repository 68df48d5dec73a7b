"""How many tokens a batch holds: the weight of an island's contribution grows with it."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def default_tokens_per_batch(batch) -> float:
    """``attention_mask`` ones, else ``input_ids`` elements, else the number of samples."""
    if isinstance(batch, Mapping):
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            return float(mask.sum())
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return float(ids.numel())
        batch = next(iter(batch.values()), None)
    if isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    if isinstance(batch, torch.Tensor):
        return float(batch.shape[0]) if batch.dim() else 1.0
    return 1.0
