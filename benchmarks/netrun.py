"""Run ``examples/train_lm.py`` as M islands (and a synchronizer) or M DDP ranks, one network
namespace each, and count the bytes on their links: shared by bandwidth.py and wan.py."""

from __future__ import annotations

import csv
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.netns import Namespaces
from lightning_diloco.launch.supervisor import clean_environment, read_progress

ROOT = Path(__file__).resolve().parents[1]
WARM = 10  # steps every unit has taken before the steady-state window opens
SYNC_PORT = 7471
DDP_PORT = 29511


@dataclass
class ArmResult:
    wire_bytes: int  # every byte put on the links (each counted once, where it was sent)
    window_bytes: int  # the same, inside each unit's steady-state window (see _watch)
    window_tokens: int
    tokens: int
    val_loss: float  # the last curve point: the full validation set, the global model
    wall_s: float
    curve: list[dict] = field(default_factory=list)

    @property
    def bytes_per_token(self) -> float:
        return self.window_bytes / max(1, self.window_tokens)


def _wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the synchronizer exited with {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


def _wire(ns: Namespaces, ddp: bool) -> int:
    # DDP ranks send to each other: what they sent is everything. Islands talk to the
    # synchronizer in the root namespace: what they sent plus what it sent them.
    return sum(_link_bytes(ns, ddp))


def run_arm(ns: Namespaces, ddp: bool, train_args: list[str], sync_args: list[str], workdir: Path,
            tokens_per_step: int, steps: int, timeout: float = 900.0) -> ArmResult:
    """``tokens_per_step``: one unit's tokens per step (batch x seq)."""
    workdir.mkdir(parents=True, exist_ok=True)
    m = ns.count
    sync = None
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        if not ddp:
            cmd = [sys.executable, "-m", "lightning_diloco.cli", "synchronizer", "--host", ns.hub, "--port", str(SYNC_PORT),
                   "--liveness-timeout", "30", *sync_args]
            sync_log = open(workdir / "synchronizer.log", "w")
            logs.append(sync_log)
            sync = subprocess.Popen(cmd, stdout=sync_log, stderr=subprocess.STDOUT, env=clean_environment({"OMP_NUM_THREADS": "1"}))
            _wait_port(ns.hub, SYNC_PORT, 60, sync)
        start_bytes = _wire(ns, ddp)
        t0 = time.monotonic()
        for i in range(m):
            env = {"OMP_NUM_THREADS": "1", "DILOCO_PROGRESS_FILE": str(workdir / f"progress-{i}.txt"),
                   "DILOCO_CHECKPOINT_DIR": str(workdir / f"checkpoints-{i}")}
            if ddp:  # one rank per namespace: Lightning sees M nodes of one device, started externally
                env.update(DILOCO_STRATEGY="ddp", DILOCO_DEVICES="1", DILOCO_NUM_NODES=str(m), NODE_RANK=str(i),
                           LOCAL_RANK="0", MASTER_ADDR=ns.address(0), MASTER_PORT=str(DDP_PORT),
                           GLOO_SOCKET_IFNAME=ns.inner_link(i))
            else:
                env.update(DILOCO_STRATEGY="decoupled_diloco", DILOCO_SYNCHRONIZER=f"{ns.hub}:{SYNC_PORT}",
                           DILOCO_ISLAND=str(i), DILOCO_NUM_ISLANDS=str(m))
            cmd = [*ns.exec_prefix(i), sys.executable, str(ROOT / "examples" / "train_lm.py"), *train_args,
                   "--steps", str(steps), "--checkpoint-every", "1000000"]
            if i == 0:
                cmd += ["--curve", str(workdir / "curve.csv")]
            log = open(workdir / f"unit-{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=clean_environment(env), cwd=ROOT))
        window = _watch(ns, ddp, procs, workdir, steps, t0 + timeout)
        wall = time.monotonic() - t0
        end_bytes = _wire(ns, ddp)
        codes = [p.returncode for p in procs]
        if any(codes):
            tail = (workdir / f"unit-{codes.index(next(c for c in codes if c))}.log").read_text()[-3000:]
            raise RuntimeError(f"{'ddp' if ddp else 'diloco'} arm: exit codes {codes}; logs in {workdir}:\n{tail}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if sync is not None:
            sync.send_signal(signal.SIGTERM)
            try:
                sync.wait(timeout=30)
            except subprocess.TimeoutExpired:
                sync.kill()
                sync.wait()
        for log in logs:
            log.close()
    window_bytes, window_steps = window
    with open(workdir / "curve.csv") as f:
        curve = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return ArmResult(
        wire_bytes=end_bytes - start_bytes, window_bytes=window_bytes, window_tokens=window_steps * tokens_per_step,
        tokens=m * steps * tokens_per_step, val_loss=curve[-1]["val_loss"], wall_s=wall, curve=curve,
    )


def _watch(ns: Namespaces, ddp: bool, procs, workdir: Path, steps: int, deadline: float):
    """Wait for the units; return (bytes, unit steps) summed over the units' own steady-state
    windows: each link from the moment its unit is past its warm-up to the moment it is near its
    end, so joins, start-up and final pulls are left out even when the units start seconds apart."""
    m = len(procs)
    opened: dict[int, tuple[int, int]] = {}
    closed: dict[int, tuple[int, int]] = {}
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the arm ran past its time limit; logs in {workdir}")
        progress = [read_progress(workdir / f"progress-{i}.txt") for i in range(m)]
        if ddp:
            progress = [progress[0]] * m  # only rank 0 writes progress; every rank is at its step
        links = _link_bytes(ns, ddp)
        for i in range(m):
            if i not in opened and progress[i] >= WARM:
                opened[i] = (links[i], progress[i])
            if i in opened and i not in closed and progress[i] >= steps - 2:
                closed[i] = (links[i], progress[i])
        time.sleep(0.05)
    if len(closed) < m:
        raise RuntimeError(f"units {sorted(set(range(m)) - set(closed))} ended before a steady-state window "
                           f"(raise --steps); logs in {workdir}")
    window_bytes = sum(closed[i][0] - opened[i][0] for i in range(m))
    window_steps = sum(closed[i][1] - opened[i][1] for i in range(m))
    if window_steps <= 0:
        raise RuntimeError(f"no steps inside the steady-state windows (raise --steps); logs in {workdir}")
    return window_bytes, window_steps


def _link_bytes(ns: Namespaces, ddp: bool) -> list[int]:
    """Per unit: what it sent (DDP: each byte once, at its sender), or what it sent and received
    (islands: the other end is the synchronizer, outside every island)."""
    return [tx if ddp else tx + rx for tx, rx in ns.counters()]
