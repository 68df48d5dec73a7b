"""What the deployment tests do with a run on their hosts: start an island's nodes and watch who
talks to the synchronizer, read `lightning-diloco status`, stop the synchronizer as an operator does."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.deploy.hosts import Hosts, tail, wait_all

RUN_TIMEOUT = 480.0  # seconds for an island's nodes to train and exit; they take about 15 s on an idle 2-core machine
ISLAND_COLUMNS = ("island", "live", "procs", "steps", "step s", "accepted", "seen s ago")


def run_island(hosts: Hosts, nodes: Sequence[str], argv: Sequence[str], logs: Sequence[Path], sync_host: str,
               port: int, **popen) -> float:
    """``argv`` on every node at once; asserts each exits 0 and that the only address seen
    connected to the synchronizer's ``port`` while they ran (sampled every 0.5 s) was that of the
    node holding the island's rank 0. Returns the seconds from their start to the last exit
    (printed for benchmarks/RESULTS.md; never asserted on)."""
    started = time.monotonic()
    procs = [hosts.start(node, argv, log, start_new_session=True, **popen) for node, log in zip(nodes, logs)]
    peers: set[str] = set()
    codes = wait_all(procs, RUN_TIMEOUT, probe=lambda: peers.update(hosts.peers(sync_host, port)))
    seconds = time.monotonic() - started
    for node, code, log in zip(nodes, codes, logs):
        assert code == 0, f"{node} exited with {code}:\n{tail(log)}"
    # the rendezvous decides which node holds rank 0; Lightning says so in that node's output
    leaders = [node for node, log in zip(nodes, logs) if f"GLOBAL_RANK: 0, MEMBER: 1/{len(nodes)}" in log.read_text()]
    assert len(leaders) == 1, leaders
    assert peers == {hosts.address(leaders[0])}, (peers, leaders)
    return seconds


def island_row(table: str, island: int) -> dict[str, str]:
    """Island ``island``'s row of `lightning-diloco status`'s table, by column."""
    lines = table.splitlines()
    assert any(line.split()[:3] == ["island", "live", "procs"] for line in lines), table
    rows = [line.split() for line in lines if line.split() and line.split()[0] == str(island)]
    assert rows, f"no row for island {island} in:\n{table}"
    return dict(zip(ISLAND_COLUMNS, rows[0]))


def outer_steps(table: str) -> int:
    return int(table.split("outer steps")[1].split()[0])


def stop_synchronizer(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM, as an operator stops a synchronizer: it writes a final checkpoint and exits 0."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the synchronizer still ran 60 s after SIGTERM:\n{tail(log)}")
    assert code == 0, f"the synchronizer exited with {code} on SIGTERM:\n{tail(log)}"
