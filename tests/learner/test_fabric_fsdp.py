"""Fabric(strategy="decoupled_diloco_fsdp"): an island of two FSDP2 processes (gloo, CPU) on a real
synchronizer, saving a distributed checkpoint and resuming from it."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric

import lightning_diloco
from lightning_diloco.core.config import CodecConfig, MergeConfig, RunConfig, ScheduleConfig
from lightning_diloco.learner.fabric_fsdp_strategy import BASES_KEY
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from tests.helpers import holds_final_global_model
from tests.learner.test_fabric_strategy import _island, _run


def _ranks(path, n):
    return [torch.load(path / f"rank{r}.pt", weights_only=False) for r in range(n)]


@pytest.mark.slow
def test_a_fabric_fsdp_island_trains_on_a_synchronizer_ends_on_the_global_model_and_resumes_its_checkpoint(tmp_path):
    """Two FSDP2 ranks (each holds half of every tensor) train an epoch on a synchronizer, save a
    distributed checkpoint and end on the global model. A second launch resumes from the
    checkpoint: every rank loads the base fragments (its shards) it saved, the counters go on,
    and it ends on the global model again. Synchronous (tau 0): no round closes after the save,
    so the resumed island keeps the checkpoint's bases rather than newer global fragments."""
    config = RunConfig(schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=0),
                       merge=MergeConfig(min_quorum=1, grace_gamma=0.0), codec=CodecConfig(uplink="fp32", downlink="fp32"))
    server = SynchronizerServer(Synchronizer(config)).start()
    ckpt = tmp_path / "island.ckpt"
    try:
        run = dict(DILOCO_SYNCHRONIZER=server.address, DILOCO_ISLAND="0", DILOCO_NUM_ISLANDS="1")
        island = ("--fsdp", "--devices", "2", "--overlap", "0")
        _run([_island(tmp_path / "first", *island, "--epochs", "1", "--save", str(ckpt), **run)])
        first = _ranks(tmp_path / "first", 2)
        final_first = holds_final_global_model(first[0]["weights"], server.service, 2)
        _run([_island(tmp_path / "resumed", *island, "--resume", str(ckpt), **run)])
        resumed = _ranks(tmp_path / "resumed", 2)
        final_resumed = holds_final_global_model(resumed[0]["weights"], server.service, 2)
        status = server.service.status()
    finally:
        server.stop(grace=0)
    # 512 samples over 2 ranks, batch 16: 16 steps an epoch; the resumed run trains the second epoch only
    assert [len(r["losses"]) for r in first] == [16, 16] and [len(r["losses"]) for r in resumed] == [16, 16]
    assert ckpt.is_dir() and (ckpt / "meta.pt").exists()  # Fabric's distributed layout, each rank's shards
    assert final_first and final_resumed, "an island that ended alone holds the final global model"
    for a, b in zip(resumed[0]["weights"], resumed[1]["weights"]):
        assert torch.equal(a, b)  # both ranks gathered the same whole model
    for r in range(2):  # each rank's shards of the base fragments come back as saved
        saved, loaded = (torch.load(tmp_path / d / f"rank{r}-bases-{k}.pt") for d, k in (("first", "saved"), ("resumed", "loaded")))
        assert all(torch.equal(s, lo) for s, lo in zip(saved, loaded)), r
        assert all(s.abs().sum() > 0 for s in saved)
    # the counters go on from the checkpoint's: 8 sends an epoch (16 steps, 2 fragments due every 4)
    assert first[0]["metrics"]["diloco/syncs_sent"] == 8 and resumed[0]["metrics"]["diloco/syncs_sent"] == 16
    assert resumed[0]["losses"][-1] < first[0]["losses"][0]
    assert status.islands[0].left and status.islands[0].accepted == 16, status.islands


def test_fabric_fsdp_strategy_by_name_and_its_checkpoint_key():
    strategy = Fabric(strategy="decoupled_diloco_fsdp", accelerator="cpu", devices=1).strategy
    assert isinstance(strategy, lightning_diloco.DecoupledDiLoCoFabricFSDPStrategy)
    assert BASES_KEY == "decoupled_diloco_bases"
    with pytest.raises(ValueError, match="tensor_parallel_size=2: tensor parallelism inside an island is not supported"):
        lightning_diloco.DecoupledDiLoCoFabricFSDPStrategy(tensor_parallel_size=2)
    with pytest.raises(TypeError, match="parallelise_fn"):
        lightning_diloco.DecoupledDiLoCoFabricFSDPStrategy(parallelise_fn=None)
