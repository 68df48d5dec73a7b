"""Multi-node islands started with torchrun, on hosts made of network namespaces: an island of
two nodes (one process each) and a synchronizer on a third host, as docs/deployment.md writes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.deploy.guide import bash, block
from tests.deploy.hosts import wait_for_text
from tests.deploy.runs import island_row, outer_steps, run_island, stop_synchronizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NODES = ("node0", "node1")
SYNC_HOST = "sync-host"
PORT = 7470  # each host has a network of its own: the documented ports cannot collide with anything
ROOT = Path(__file__).resolve().parents[2]


def test_an_island_of_two_nodes_from_the_guide_trains_and_only_its_rank_0_talks_to_the_synchronizer(
        hosts_factory, clone, environment, tmp_path):
    hosts = hosts_factory([*NODES, SYNC_HOST])
    token = subprocess.run(hosts.command(SYNC_HOST, bash(block("secrets.token_hex"))), cwd=clone, env=environment,
                           capture_output=True, text=True, timeout=120)
    assert token.returncode == 0 and (clone / "run.token").read_text().strip(), token.stdout + token.stderr
    sync_log = tmp_path / "synchronizer.log"
    sync = hosts.start(SYNC_HOST, bash(block(".venv/bin/lightning-diloco synchronizer --host 0.0.0.0")), sync_log, cwd=clone, env=environment,
                       start_new_session=True)
    wait_for_text(sync_log, "synchronizer listening on", sync, timeout=120)

    logs = [tmp_path / f"island-{node}.log" for node in NODES]
    seconds = run_island(hosts, NODES, bash(block("torchrun --nnodes 2")), logs, SYNC_HOST, PORT, cwd=clone, env=environment)

    status = subprocess.run(hosts.command("node1", bash(block("lightning-diloco status sync-host"))), cwd=clone,
                            env=environment, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    stop_synchronizer(sync, sync_log)
    table = status.stdout
    island = island_row(table, 0)
    # what the operator sees: one island of 2 processes, its contributions merged into outer steps
    assert island["procs"] == "2" and int(island["accepted"]) > 0 and outer_steps(table) > 0, table
    assert "refused {}" in table, table  # a second rank joining would have ended rank 0's session: its calls refused
    output = "".join(log.read_text() for log in logs)
    assert "final val_loss" in output and "island 0 of 1 (2 process(es))" in output, output[-4000:]
    assert list((clone / "sync-ckpt").iterdir()), "SIGTERM wrote no final checkpoint"
    print(f"DDP island of 2 nodes (the guide's torchrun line): {outer_steps(table)} outer steps, {island['accepted']} "
          f"contributions accepted, {island['steps']} steps, {seconds:.1f} s from torchrun's start to both nodes' exit")


def test_an_fsdp2_island_of_two_nodes_keeps_its_ranks_equal(hosts_factory, environment, tmp_path):
    """decoupled_diloco_fsdp over two nodes: each node holds half of every tensor; both end on the
    same model and the synchronizer took outer steps from the island's rank 0 only."""
    hosts = hosts_factory([*NODES, SYNC_HOST])
    sync_log = tmp_path / "synchronizer.log"
    sync = hosts.start(SYNC_HOST, [sys.executable, "-m", "lightning_diloco.cli", "synchronizer", "--host", "0.0.0.0",
                                   "--port", str(PORT), "--num-fragments", "2", "--sync-every", "4", "--uplink-codec", "fp32",
                                   "--downlink-codec", "fp32"], sync_log, env=environment, start_new_session=True)
    wait_for_text(sync_log, "synchronizer listening on", sync, timeout=120)
    env = dict(environment, DILOCO_SYNCHRONIZER=f"{SYNC_HOST}:{PORT}", DILOCO_ISLAND="0", DILOCO_NUM_ISLANDS="1")
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "fsdp-island"]
    script = [str(ROOT / "tests" / "learner" / "island_script.py"), str(tmp_path / "out"), "--fsdp", "--num-nodes", "2",
              "--max-steps", "16", "--epochs", "10", "--step-seconds", "0"]
    logs = [tmp_path / f"fsdp-{node}.log" for node in NODES]
    seconds = run_island(hosts, NODES, torchrun + script, logs, SYNC_HOST, PORT, cwd=ROOT, env=env)
    status = subprocess.run(hosts.command("node1", [sys.executable, "-m", "lightning_diloco.cli", "status",
                                                    f"{SYNC_HOST}:{PORT}", "--json"]),
                            env=environment, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    stop_synchronizer(sync, sync_log)
    shard = json.loads(status.stdout)[0]
    assert {i: isl["world_size"] for i, isl in shard["islands"].items()} == {"0": 2}, shard["islands"]
    assert shard["outer_steps"] >= 4 and shard["refused"] == {}, shard
    ranks = [torch.load(tmp_path / "out" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["steps"] for r in ranks] == [16, 16]
    assert ranks[0]["metrics"]["diloco/syncs_applied"] >= 4 and ranks[0]["metrics"]["diloco/syncs_failed"] == 0
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert torch.equal(a, b)
    print(f"FSDP2 island of 2 nodes: {shard['outer_steps']} outer steps, {shard['islands']['0']['accepted']} contributions "
          f"accepted, 16 steps, {seconds:.1f} s from torchrun's start to both nodes' exit")
