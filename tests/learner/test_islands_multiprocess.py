"""Islands as real processes: two islands on one synchronizer, an island of two DDP ranks, and a
blocked island stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_diloco.core.config import CodecConfig, MergeConfig, RunConfig, ScheduleConfig
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.helpers import holds_final_global_model

SCRIPT = Path(__file__).with_name("island_script.py")
pytestmark = pytest.mark.slow


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DILOCO_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(procs, timeout=240):
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outputs.append(out)
        assert proc.returncode == 0, out[-3000:]
    return outputs


def test_two_islands_contribute_and_the_last_to_end_holds_the_final_global_model(tmp_path):
    config = RunConfig(
        schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1),
        merge=MergeConfig(min_quorum=2, grace_gamma=0.0),
        codec=CodecConfig(uplink="fp32", downlink="fp32"),
    )
    server = SynchronizerServer(Synchronizer(config)).start()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPT), str(tmp_path / f"island{i}")],
                env=_env(DILOCO_SYNCHRONIZER=server.address, DILOCO_ISLAND=str(i), DILOCO_NUM_ISLANDS="2"),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for i in range(2)
        ]
        _run(procs)
        status = server.service.status()
        results = [torch.load(tmp_path / f"island{i}" / "rank0.pt", weights_only=False) for i in range(2)]
        # the island that ended last holds the final global model; the one that ended first left
        # the run (Leave), so the other's last rounds closed without it (quorum 2 lowered to the
        # one island still in the run) and it may hold the version before those
        final = [holds_final_global_model(r["weights"], server.service, 2) for r in results]
    finally:
        server.stop(grace=0)
    # each island saw its own half of the data: 512 samples / 2 islands / batch 16 = 16 steps per epoch
    assert [r["steps"] for r in results] == [32, 32]
    assert all(isl.accepted >= 8 for isl in status.islands.values()), status.islands
    assert status.accepted["merged"] == sum(isl.accepted for isl in status.islands.values())
    assert any(final) and all(isl.left for isl in status.islands.values()), (final, status.islands)


def test_islands_started_out_of_phase_share_one_round_per_due_step(tmp_path):
    """Quorum 1, the second island started seconds after the first: rounds follow the run's clock,
    so the late island joins in phase and the fragments see one outer step per due step, not one
    per island (what the old round structure did)."""
    import time

    config = RunConfig(
        schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1),
        merge=MergeConfig(min_quorum=1, grace_gamma=0.5),
        codec=CodecConfig(uplink="fp32", downlink="fp32"),
    )
    server = SynchronizerServer(Synchronizer(config)).start()
    try:
        procs = []
        for i in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPT), str(tmp_path / f"island{i}"), "--no-wait", "--epochs", "8", "--step-seconds", "0.05"],
                env=_env(DILOCO_SYNCHRONIZER=server.address, DILOCO_ISLAND=str(i), DILOCO_NUM_ISLANDS="2"),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            ))
            time.sleep(3.0)
        _run(procs)
        status = server.service.status()
    finally:
        server.stop(grace=0)
    results = [torch.load(tmp_path / f"island{i}" / "rank0.pt", weights_only=False) for i in range(2)]
    schedule = max(r["metrics"]["diloco/schedule_step"] for r in results)
    for p, rounds in status.rounds.items():
        assert rounds.closed <= schedule / 4 + 1, (p, rounds, schedule)  # at most one step per round
    merged = sum(r.merged_entries for r in status.rounds.values())
    # rounds held both islands: more entries merged than rounds closed (one entry per round is what
    # islands closing rounds of their own would give, and the bound above fails for that). Not a
    # ratio: on an idle machine it is 1.75, but under load pushes outlast a round, due sends are
    # skipped while one is in flight (by design): a clean-clone CI run read 95 / 78 = 1.22
    assert merged > sum(r.closed for r in status.rounds.values()), (merged, status.rounds)
    assert results[1]["metrics"]["diloco/schedule_step"] > results[1]["steps"]  # the late one started at the run's step
    assert all(isl.accepted >= 8 for isl in status.islands.values()), status.islands


def test_an_island_of_two_ddp_processes_stays_consistent(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path), "--devices", "2"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    _run([proc])
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"] == 32  # 512 samples over 2 ranks, batch 16, 2 epochs
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert torch.equal(a, b)  # every rank applied the same fragments at the same steps
    leader = ranks[0]["metrics"]
    assert leader["diloco/syncs_applied"] >= 6 and leader["diloco/syncs_failed"] == 0
    assert ranks[1]["metrics"]["diloco/syncs_applied"] == leader["diloco/syncs_applied"]
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


def test_a_blocked_synchronous_island_stops_within_seconds_of_sigterm_and_leaves_the_run(tmp_path):
    """tau = 0 and K = M = 2 with the other island gone: the island waits for its round, which no
    quorum will close, up to push_wait (120 s) at every due fragment. The launcher's SIGTERM (its
    stop at the end of a run) took 35 s to end such an island; now it ends the wait at once, the
    island tells the synchronizer it leaves, and exits by itself (not killed by the signal)."""
    config = RunConfig(
        schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=0),
        merge=MergeConfig(min_quorum=2, grace_gamma=0.0),
        codec=CodecConfig(uplink="fp32", downlink="fp32"),
    )
    server = SynchronizerServer(Synchronizer(config, SynchronizerSettings(num_islands=2))).start()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path / "island0"), "--no-wait", "--overlap", "0"],
        env=_env(DILOCO_SYNCHRONIZER=server.address, DILOCO_ISLAND="0", DILOCO_NUM_ISLANDS="2"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 180  # a hang guard for the start (Lightning's import under load)
        while not any(r.open for r in server.service.status().rounds.values()):  # its first send waits for a quorum
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)[0][-3000:]
            time.sleep(0.1)
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)  # a hang guard: the old wait alone was 120 s
        took = time.monotonic() - stopped_at
        status = server.service.status()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        server.stop(grace=0)
    assert took < 20, f"SIGTERM took {took:.1f} s to end a blocked island\n{out[-3000:]}"
    assert proc.returncode >= 0, out[-3000:]  # it ended itself, through Lightning's stop and the teardown
    assert status.islands[0].left and status.live_islands == [], status.islands
