"""FSDP2 islands as real processes (gloo, CPU): one layout for every island shape, the same
algorithm whatever the inner parallelism."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lightning_diloco.core.config import CodecConfig, MergeConfig, RunConfig, ScheduleConfig
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from tests.helpers import holds_final_global_model
from tests.learner.models import TinyRegressor
from tests.learner.test_islands_multiprocess import SCRIPT, _env, _run

pytestmark = pytest.mark.slow


def _island(out, *args, **env):
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out), *args], env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ranks(path, n):
    return [torch.load(path / f"rank{r}.pt", weights_only=False) for r in range(n)]


def test_an_fsdp_island_and_a_one_process_island_join_one_run_and_the_last_to_end_holds_the_final_model(tmp_path):
    """The FSDP2 island's ranks each hold half of every tensor; its layout (built from the whole
    shapes and names) is the one-process island's, so both join, contribute to every round
    (quorum 2), and the one that ends last holds the final global model."""
    config = RunConfig(
        schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1),
        merge=MergeConfig(min_quorum=2, grace_gamma=0.0),
        codec=CodecConfig(uplink="fp32", downlink="fp32"),
    )
    server = SynchronizerServer(Synchronizer(config), port=0).start()
    try:
        run = dict(DILOCO_SYNCHRONIZER=server.address, DILOCO_NUM_ISLANDS="2")
        steps = ("--max-steps", "24", "--epochs", "10", "--step-seconds", "0.05")
        procs = [_island(tmp_path / "fsdp", "--fsdp", "--devices", "2", *steps, DILOCO_ISLAND="0", **run),
                 _island(tmp_path / "single", *steps, DILOCO_ISLAND="1", **run)]
        _run(procs)
        status = server.service.status()
        fsdp, single = _ranks(tmp_path / "fsdp", 2), _ranks(tmp_path / "single", 1)[0]
        # the island that ended last holds the final global model (the first left the run, and
        # the other's last rounds closed without it); the FSDP island's ranks hold the same model
        final = [holds_final_global_model(r["weights"], server.service, 2) for r in (fsdp[0], single)]
    finally:
        server.stop(grace=0)
    assert [r["steps"] for r in fsdp] == [24, 24] and single["steps"] == 24
    # 24 steps, each fragment due every 4: 6 sends per fragment, 12 per island
    # Quorum 2: every closed round merged both. Of the 12 sends per island, those for rounds the
    # other island never reached stay unmerged (a slower island is realigned to the run's clock,
    # and its last sends can outrun the other's end): 7 to 12 accepted on this machine
    assert all(isl.accepted >= 4 for isl in status.islands.values()), status.islands
    assert status.accepted["merged"] == sum(isl.accepted for isl in status.islands.values())
    assert any(final), final
    for rank in fsdp:
        assert rank["metrics"]["diloco/syncs_failed"] == 0
        for a, b in zip(rank["weights"], fsdp[0]["weights"]):
            assert torch.equal(a, b)


def test_ddp_and_fsdp_islands_compute_the_same_global_model(tmp_path):
    """Synchronous DiLoCo (overlap 0), same seeds and data: an island of 2 DDP ranks and one of 2
    FSDP2 ranks send the same outer gradients, so the global model after 4 outer steps of each
    fragment is the same within float tolerance (the gradient reductions sum in other orders)."""
    procs = [_island(tmp_path / kind, *flags, "--devices", "2", "--overlap", "0", "--max-steps", "16", "--epochs", "10")
             for kind, flags in (("ddp", ()), ("fsdp", ("--fsdp",)))]
    _run(procs)
    ddp, fsdp = _ranks(tmp_path / "ddp", 2)[0], _ranks(tmp_path / "fsdp", 2)[0]
    assert ddp["metrics"]["diloco/syncs_applied"] == fsdp["metrics"]["diloco/syncs_applied"] == 8
    for a, b in zip(ddp["weights"], fsdp["weights"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    initial = list(TinyRegressor(seed=0).parameters())
    assert all((a - b.detach()).abs().max() > 1e-3 for a, b in zip(ddp["weights"], initial))  # it trained


def test_an_fsdp_island_resumed_from_its_checkpoint_matches_an_uninterrupted_run(tmp_path):
    """Synchronous, so deterministic: 1 epoch, checkpoint, resume for a 2nd from another init
    gives the model 2 uninterrupted epochs give, from a distributed checkpoint (the bases saved
    sharded beside the weights) and from a full one (gathered on rank 0); and in bf16-true, whose
    bases are fp32 beside bf16 weights (loaded as bf16, they were rounded: not the same run)."""
    common = ("--fsdp", "--devices", "2", "--overlap", "0")
    kinds = {"distributed": (), "full": ("--full-checkpoint",), "distributed-bf16": ("--precision", "bf16-true")}
    firsts = {kind: _island(tmp_path / f"first-{kind}", *common, "--epochs", "1", "--checkpoint-dir",
                            str(tmp_path / f"ckpt-{kind}"), *extra)
              for kind, extra in kinds.items()}
    _run([_island(tmp_path / "straight", *common, "--epochs", "2"),
          _island(tmp_path / "straight-bf16", *common, "--epochs", "2", "--precision", "bf16-true"), *firsts.values()])
    assert (tmp_path / "ckpt-distributed" / "last.ckpt").is_dir() and (tmp_path / "ckpt-full" / "last.ckpt").is_file()
    _run([_island(tmp_path / f"resumed-{kind}", *common, "--epochs", "2", "--seed", "5", "--resume",
                  str(tmp_path / f"ckpt-{kind}" / "last.ckpt"), *kinds[kind])
          for kind in firsts])
    for kind in firsts:
        straight = _ranks(tmp_path / ("straight-bf16" if kind.endswith("bf16") else "straight"), 2)[0]
        resumed = _ranks(tmp_path / f"resumed-{kind}", 2)
        assert [r["steps"] for r in resumed] == [16, 16]  # the second epoch only
        assert resumed[0]["metrics"]["diloco/min_version"] == 8  # 32 steps / H = 4 per fragment
        for a, b in zip(straight["weights"], resumed[0]["weights"]):
            assert a.dtype == (torch.bfloat16 if kind.endswith("bf16") else torch.float32)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
