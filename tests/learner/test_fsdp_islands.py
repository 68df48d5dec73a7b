"""FSDP2 islands as real processes (gloo, CPU): one layout for every island shape, the same
algorithm whatever the inner parallelism."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time

import pytest
import torch

from lightning_diloco.core.config import CodecConfig, MergeConfig, RunConfig, ScheduleConfig
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
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


def test_a_sparse_uplinks_residual_kept_in_the_parameters_reaches_every_rank_of_ddp_and_fsdp_islands(tmp_path):
    """``uplink_residual="parameters"`` with the sparse codec (a quarter of each fragment sent): at
    each apply the leader shares its push's residual and every rank adds its part, so the ranks of
    a DDP island and of an FSDP2 island stay equal, the two islands compute the same model, and it
    is another model than the one the residual kept for the next push gives."""
    # overwrite: mix keeps part of the unsent progress and is refused with the residual kept (core/config.py)
    sparse = ("--setting", "uplink_codec=sparse", "--setting", "sparse_density=0.25", "--setting", "apply=overwrite")
    common = ("--devices", "2", "--overlap", "0", "--max-steps", "16", "--epochs", "10", *sparse)
    kept = ("--setting", "uplink_residual=parameters")
    runs = {"ddp": (*common, *kept), "fsdp": ("--fsdp", *common, *kept), "ddp-push": common}
    _run([_island(tmp_path / kind, *flags) for kind, flags in runs.items()])
    ranks = {kind: _ranks(tmp_path / kind, 2) for kind in runs}
    for kind, (first, second) in ranks.items():
        assert first["metrics"]["diloco/syncs_applied"] == 8, kind
        for a, b in zip(first["weights"], second["weights"]):
            assert torch.equal(a, b), kind
    for a, b in zip(ranks["ddp"][0]["weights"], ranks["fsdp"][0]["weights"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(ranks["ddp"][0]["weights"], ranks["ddp-push"][0]["weights"]))


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


def _killed(server: SynchronizerServer) -> None:
    """Stop ``server`` as a SIGKILL would: no final checkpoint (the versions published since the
    last one are in its version log alone), its directory released for the next one."""
    server.service.shutdown()
    server.server.stop(0).wait()
    server.servicer.deadlines.close()
    server.executor.shutdown(wait=True)


def _paused(control, n, proc, timeout=120.0) -> dict:
    """The island's versions once it pauses at step ``n`` (island_script.py's PauseAt)."""
    path, deadline = control / f"paused-{n}.json", time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"the island did not pause at step {n} within {timeout:.0f} s"
        time.sleep(0.05)
    return {p: v for p, v in enumerate(json.loads(path.read_text())["versions"])}


def _taken_back(log: str) -> dict[int, int]:
    """Fragment -> the version a restarted synchronizer took back from an island, as it logs it."""
    return {int(p): int(v) for p, v in re.findall(r"fragment (\d+): version (\d+) taken back from island", log)}


def test_an_fsdp_island_gives_back_the_versions_it_holds_to_a_synchronizer_restarted_from_an_older_checkpoint(
        tmp_path, caplog):
    """Issue 48, 4(c): every fragment of the FSDP2 island is sharded, whole on no rank. The
    synchronizer checkpoints early, publishes more versions (logged), and is killed; restarted, it
    serves neither fragment until an island gives it back. The island gathers each one at a step
    boundary and its leader offers it: the restart serves exactly the versions the island held,
    at once. Before, it offered nothing, and each fragment waited the whole recovery wait (here
    600 s) before the checkpoint's version was served, the versions since lost."""
    config = RunConfig(
        schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1),
        merge=MergeConfig(min_quorum=1, grace_gamma=0.0),
        codec=CodecConfig(uplink="fp32", downlink="fp32"),
    )

    def synchronizer(port=0):
        settings = SynchronizerSettings(checkpoint_dir=tmp_path / "sync", recovery_wait=600, num_islands=1)
        return SynchronizerServer(Synchronizer(config, settings), port=port).start()

    control = tmp_path / "control"
    control.mkdir()
    caplog.set_level(logging.WARNING, logger="lightning_diloco.synchronizer")
    servers = [synchronizer()]
    island = _island(tmp_path / "fsdp", "--fsdp", "--devices", "2", "--max-steps", "200", "--epochs", "100",
                     "--step-seconds", "0.05", "--pause-at", "2,24", "--control", str(control),
                     DILOCO_SYNCHRONIZER=servers[0].address, DILOCO_NUM_ISLANDS="1")
    try:
        _paused(control, 2, island)
        servers[0].service.checkpoint()  # the only checkpoint: every later version is the log's alone
        checkpointed = servers[0].service.versions()
        (control / "resume-2").touch()
        held = _paused(control, 24, island)
        assert held == servers[0].service.versions()  # it holds the newest versions...
        assert all(held[p] > checkpointed[p] for p in held), (held, checkpointed)  # ...newer than the checkpoint's
        port = servers[0].port
        _killed(servers.pop())
        servers.append(synchronizer(port))
        assert servers[0].service.versions() == {0: -1, 1: -1}  # served to no one until given back
        (control / "resume-24").touch()
        deadline = time.monotonic() + 120  # a fifth of the recovery wait: a stall would run past it
        while len(resumed := _taken_back(caplog.text)) < len(held):
            assert island.poll() is None and time.monotonic() < deadline, (resumed, held)
            time.sleep(0.05)
        assert resumed == held  # nothing the island held was lost (each fragment trains on once served)
        _run([island])
        final = servers[0].service.versions()
    finally:
        if island.poll() is None:
            island.kill()
            island.communicate()
        for server in servers:
            server.stop(grace=0)
    assert "LOST" not in caplog.text, caplog.text
    assert all(final[p] > held[p] for p in held), (final, held)  # it trained on with the restarted synchronizer
