"""deploy/slurm/island.sbatch as SLURM would run it, on hosts made of network namespaces.

No SLURM here, so the test plays its part: it reads the job's shape from the script's ``#SBATCH``
lines, runs the script itself on the job's first node with the variables SLURM gives a batch job,
and puts an ``srun`` first on the PATH that starts the job step's command once per task, task t on
its node with the variables srun gives a task (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NODEID``). Lightning's SLURMEnvironment has to form the island from those alone: nothing
else tells the processes their ranks or where the rendezvous is.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.guide import bash, block
from tests.deploy.hosts import tail, wait_all, wait_for_text
from tests.deploy.runs import RUN_TIMEOUT, island_row, outer_steps, stop_synchronizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "island.sbatch"
JOB_ID = "4242"
SYNC_HOST = "sync-host"
PORT = 7470  # the guide's, on a host of its own

SRUN = '''#!{python}
"""srun as the test plays it: the job step's command once per task, each on its node."""
import os, subprocess, sys

NODES = {nodes!r}  # per node: the command prefix that runs on it
PER_NODE = {per_node}
args = sys.argv[1:]
while args and args[0].startswith("-"):  # srun's own options take the --name=value form here
    args = args[1:]
procs = []
for task in range(len(NODES) * PER_NODE):
    node = task // PER_NODE
    env = dict(os.environ, SLURM_PROCID=str(task), SLURM_LOCALID=str(task % PER_NODE), SLURM_NODEID=str(node),
               SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(len(NODES) * PER_NODE), SLURM_STEP_NUM_NODES=str(len(NODES)))
    procs.append(subprocess.Popen(NODES[node] + args, env=env))
codes = [p.wait() for p in procs]
sys.exit(next((c for c in codes if c), 0))
'''


def sbatch_options(script: Path) -> dict[str, str]:
    """The ``#SBATCH --name=value`` lines, before the first command (where sbatch stops reading)."""
    options = {}
    for line in script.read_text().splitlines()[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if match := re.match(r"#SBATCH\s+--([\w-]+)=(\S+)", line):
            options[match.group(1)] = match.group(2)
    return options


def test_the_sbatch_script_forms_one_island_across_two_nodes(hosts_factory, clone, environment, tmp_path):
    options = sbatch_options(SBATCH)
    num_nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    assert (num_nodes, per_node) == (2, 1), options  # the job this test plays: two hosts of one task
    nodes = [f"node{i}" for i in range(num_nodes)]
    hosts = hosts_factory([*nodes, SYNC_HOST])
    token = subprocess.run(hosts.command(SYNC_HOST, bash(block("secrets.token_hex"))), cwd=clone, env=environment,
                           capture_output=True, text=True, timeout=120)
    assert token.returncode == 0, token.stdout + token.stderr
    sync_log = tmp_path / "synchronizer.log"
    sync = hosts.start(SYNC_HOST, bash(block(".venv/bin/lightning-diloco synchronizer --host 0.0.0.0")), sync_log, cwd=clone, env=environment,
                       start_new_session=True)
    wait_for_text(sync_log, "synchronizer listening on", sync, timeout=120)

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(SRUN.format(python=sys.executable, nodes=[hosts.command(n, []) for n in nodes], per_node=per_node))
    srun.chmod(0o755)
    job = dict(  # what SLURM sets for the batch script, from the #SBATCH lines
        environment, PATH=f"{bin_dir}:{environment['PATH']}", SLURM_JOB_ID=JOB_ID, SLURM_JOBID=JOB_ID,
        SLURM_JOB_NAME=options["job-name"], SLURM_JOB_NUM_NODES=str(num_nodes), SLURM_NNODES=str(num_nodes),
        SLURM_NTASKS=str(num_nodes * per_node), SLURM_NPROCS=str(num_nodes * per_node), SLURM_NTASKS_PER_NODE=str(per_node),
        SLURM_JOB_NODELIST=f"node[0-{num_nodes - 1}]", SLURM_NODELIST=f"node[0-{num_nodes - 1}]",
        SLURM_CPUS_PER_TASK=options["cpus-per-task"], SLURM_SUBMIT_DIR=str(clone),
        # and what `sbatch --export=ALL,DILOCO_SYNCHRONIZER=...,DILOCO_ISLAND=0,DILOCO_NUM_ISLANDS=1` adds
        DILOCO_SYNCHRONIZER=f"{SYNC_HOST}:{PORT}", DILOCO_ISLAND="0", DILOCO_NUM_ISLANDS="1",
    )
    job_log = tmp_path / "island.log"
    started = time.monotonic()
    batch = hosts.start(nodes[0], ["bash", str(SBATCH), "--steps", "24"], job_log, cwd=clone, env=job, start_new_session=True)
    peers: set[str] = set()
    [code] = wait_all([batch], RUN_TIMEOUT, probe=lambda: peers.update(hosts.peers(SYNC_HOST, PORT)))
    assert code == 0, f"the batch script exited with {code}:\n{tail(job_log)}"
    seconds = time.monotonic() - started

    status = subprocess.run(hosts.command(nodes[1], bash(block("lightning-diloco status sync-host"))), cwd=clone,
                            env=environment, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stdout + status.stderr
    stop_synchronizer(sync, sync_log)
    output = job_log.read_text()
    # the ranks came from SLURM's variables (no RANK, WORLD_SIZE or MASTER_ADDR was set)
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in output and "GLOBAL_RANK: 1, MEMBER: 2/2" in output, tail(job_log)
    assert "final val_loss" in output and "island 0 of 1 (2 process(es))" in output, tail(job_log)
    island = island_row(status.stdout, 0)
    assert island["procs"] == "2" and int(island["accepted"]) > 0 and "refused {}" in status.stdout, status.stdout
    assert peers == {hosts.address("node0")}, peers  # rank 0's node (SLURM_PROCID 0) only
    print(f"SLURM island of 2 nodes (deploy/slurm/island.sbatch): {outer_steps(status.stdout)} outer steps, {island['accepted']} "
          f"contributions accepted, {island['steps']} steps, {seconds:.1f} s from the batch script's start to its exit")
