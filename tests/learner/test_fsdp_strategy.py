"""The FSDP2 island strategy's arguments (the runs are in test_fsdp_islands.py: they need processes)."""

from __future__ import annotations

import pytest

import lightning_diloco  # noqa: F401  registers the strategy names
from lightning_diloco import DecoupledDiLoCoFSDPStrategy
from tests.learner.models import trainer


def test_the_registered_name_builds_an_fsdp_island_over_all_devices():
    t = trainer("decoupled_diloco_fsdp", devices=2)
    assert isinstance(t.strategy, DecoupledDiLoCoFSDPStrategy)
    assert (t.strategy._data_parallel_size, t.strategy._tensor_parallel_size) == ("auto", 1)
    assert t.strategy.num_processes == 2


def test_run_settings_and_model_parallel_arguments_are_taken_and_checked():
    strategy = DecoupledDiLoCoFSDPStrategy(synchronizer="127.0.0.1:1", island=1, num_islands=2, sync_every=8, min_quorum=2, outlier_z=5.0,
                                           save_distributed_checkpoint=False)
    assert (strategy.island, strategy.run_config.schedule.sync_every, strategy.run_config.merge.min_quorum) == (1, 8, 2)
    assert strategy.run_config.merge.outlier_z == 5.0 and strategy._save_distributed_checkpoint is False
    with pytest.raises(ValueError, match="overlap_steps=30"):
        DecoupledDiLoCoFSDPStrategy(overlap_steps=30)
    with pytest.raises(TypeError, match="'save_distributed_checkpoints' \\(did you mean 'save_distributed_checkpoint'\\?\\)"):
        DecoupledDiLoCoFSDPStrategy(save_distributed_checkpoints=False)
    with pytest.raises(TypeError, match="nor ModelParallelStrategy arguments"):
        DecoupledDiLoCoFSDPStrategy(find_unused_parameters=True)  # a DDP argument, not FSDP2's
    with pytest.raises(ValueError, match="tensor_parallel_size=2: tensor parallelism inside an island is not supported"):
        DecoupledDiLoCoFSDPStrategy(tensor_parallel_size=2)
