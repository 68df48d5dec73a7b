"""The strategy in one process with the embedded synchronizer."""

from __future__ import annotations

import copy

import pytest
import torch

import lightning_diloco  # noqa: F401  registers the strategy names
from lightning_diloco import DecoupledDiLoCoStrategy
from tests.learner.models import TinyRegressor, loader, regression_data, trainer


def test_strategy_name_trains_a_tiny_model_and_syncs():
    model = TinyRegressor()
    t = trainer("decoupled_diloco", max_epochs=3)
    t.fit(model, loader(regression_data()))
    learner_metrics = t.strategy.learner  # torn down after fit
    assert learner_metrics is None
    first, last = sum(model.losses[:8]) / 8, sum(model.losses[-8:]) / 8
    assert last < 0.5 * first
    assert isinstance(t.strategy, DecoupledDiLoCoStrategy)
