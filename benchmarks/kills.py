"""Versions handed out against versions resumed, over SIGKILLs of the synchronizer in a row.

    python -m benchmarks.kills [--kills 8] [--numel 65536] [--run-s 10] [--window-s 10] [--downlink-codec fp32]

One synchronizer process on loopback (``--checkpoint-every 1``, 2 fragments of ``--numel``
floats each, quorum 1, no grace window, fp32 uplink, ``--downlink-codec``) and 2 islands as
threads of this process. Each island holds the global fragments as a learner island does: pulled
once, then the versions its subscription brings, applied as the island applies them (learner/
inbox.py sums what arrives between two takes; a delta is added to the value held), and pushes
each fragment in turn against the version it holds, as fast as the synchronizer answers. It
offers what it holds (a seed) when a fragment is refused as waiting to be given back
(synchronizer/version_log.py), as a learner island's heartbeat does. Each cycle runs the load
``--run-s`` seconds, SIGKILLs the synchronizer, restarts it on the same port and reads the
versions it serves once every fragment is served again (recovered from an island, or at most
30 s later its checkpoint's); a version an island was given (a pull's answer or a subscription's
event) that the restarted one does not have is lost. Then the rounds the run closes (one outer
step each) in ``--window-s`` seconds after the restart, against the same window before the
kill. Prints one line per kill and a sum.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.config import CodecConfig
from lightning_diloco.core.fragments import TensorSpec, build_layout
from lightning_diloco.core.protocol import Contribution, VersionUpdate
from lightning_diloco.learner.inbox import Inbox
from lightning_diloco.reasons import Reason
from lightning_diloco.transport.client import SynchronizerClient

ISLANDS = 2
RECOVERY_WAIT = 30.0


def _start(directory: str, port: str, downlink: str) -> tuple[subprocess.Popen, str, dict[int, int]]:
    """The process, its address and the versions it resumed at (its log says them before it listens)."""
    cmd = [sys.executable, "-m", "lightning_diloco.cli", "synchronizer", "--host", "127.0.0.1", "--port", port,
           "--checkpoint-dir", directory, "--checkpoint-every", "1", "--num-fragments", "2", "--sync-every", "4",
           "--overlap-steps", "1", "--min-quorum", "1", "--grace-gamma", "0", "--uplink-codec", "fp32",
           "--downlink-codec", downlink, "--liveness-timeout", "5", "--recovery-wait", str(RECOVERY_WAIT)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    resumed: dict[int, int] = {}
    for line in proc.stdout:
        found = re.search(r"resumed run .* \(versions (\{.*?\})\)", line)
        if found:
            resumed = {int(k): v for k, v in ast.literal_eval(found[1]).items()}
        if line.startswith("synchronizer listening on "):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
            return proc, line.split()[-1], resumed
    raise RuntimeError(f"the synchronizer did not start (exit {proc.wait()})")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Load:
    """The islands' threads: what each fragment's highest version handed out is, and how many sends failed."""

    def __init__(self, address: str, specs: list[TensorSpec], numel: list[int]) -> None:
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.seen = {0: 0, 1: 0}
        self.failed = 0
        self.layout_hash = build_layout(specs, 2).hash
        self.clients = [SynchronizerClient(address, max_retries=60, backoff=0.05, max_backoff=0.5) for _ in range(ISLANDS)]
        self.specs, self.numel = specs, numel
        self.threads = [threading.Thread(target=self._island, args=(i,), name=f"diloco-bench-kills-{i}") for i in range(ISLANDS)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)
        for c in self.clients:
            c.close()

    def _island(self, i: int) -> None:
        client, seq, named = self.clients[i], 0, 0
        g = torch.Generator().manual_seed(i)  # steps of 1e-3 about weights of 0.02, some changing sign, as training's
        payloads = [get_codec("fp32").encode(1e-3 * torch.randn(n, generator=g)) for n in self.numel]
        held: dict[int, tuple[int, torch.Tensor]] = {p: client.pull(p) for p in range(2)}  # fragment -> (version, value)
        inbox = Inbox([held[p][0] for p in range(2)], self.numel, CodecConfig().block_size)

        def on_version(event: VersionUpdate) -> None:
            with self.lock:  # a version handed out
                self.seen[event.fragment] = max(self.seen[event.fragment], event.version)
            inbox.on_version(event)

        client.subscribe(i, inbox.held, on_request=inbox.on_request, on_version=on_version, on_reconnect=inbox.on_reconnect)
        while not self.stop.is_set():
            for a in inbox.take(lambda a: True):  # as the island's apply: a delta onto the value held
                held[a.fragment] = (a.version, a.value if a.base_version < 0 else held[a.fragment][1] + a.value)
            p = seq % 2
            version = held[p][0]
            try:
                seq += 1
                ack = client.push(Contribution(island=i, fragment=p, round=max(version + 1, named), base_version=version,
                                               tokens=100.0, steps=4, codec="fp32", seq=seq, payload=payloads[p],
                                               layout_hash=self.layout_hash))
                named = ack.round + (0 if ack.late else 1)
                inbox.wait(lambda: p in inbox.fresh, 1.0)  # noqa: B023 - called here: the version of its round
            except Exception as err:  # noqa: BLE001 - counted: a send may meet the kill
                if self.stop.is_set():
                    return
                with self.lock:
                    self.failed += 1
                if getattr(err, "reason", None) == Reason.NOT_SEEDED:  # a fragment waits to be given back
                    try:
                        for f, (_, value) in held.items():  # each one held, as a learner's heartbeat offers each waiting
                            client.seed(i, f, value)
                    except Exception:  # noqa: BLE001 - counted with the failed sends, offered again at the next
                        self.stop.wait(0.1)
                    continue
                if client.shard_sessions.absent(0):  # it gave up on the synchronizer: join again once it is back
                    try:
                        client.join(i, 1, self.specs, num_islands=ISLANDS, patience=60)
                    except Exception:  # noqa: BLE001 - counted, tried again at the next send
                        self.stop.wait(0.1)


def _rounds_closed(address: str) -> int:
    """Rounds the synchronizer closed since it started, one outer step each (its outer_steps would
    count a version given back after a restart as the steps from the checkpoint's to it)."""
    with SynchronizerClient(address, max_retries=20, backoff=0.1) as c:
        return sum(r.closed for r in c.status().rounds.values())


def _served(address: str, timeout: float) -> tuple[dict[int, int], float]:
    """The versions the synchronizer serves once no fragment waits to be given back (-1), and the
    seconds that took."""
    started = time.monotonic()
    with SynchronizerClient(address, max_retries=20, backoff=0.1) as c:
        while True:
            versions = c.status().versions
            if min(versions.values()) >= 0 or time.monotonic() - started > timeout:
                return versions, time.monotonic() - started
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=8)
    p.add_argument("--numel", type=int, default=65536, help="floats per fragment (default %(default)s)")
    p.add_argument("--run-s", type=float, default=10.0, help="seconds of load before each kill (default %(default)s)")
    p.add_argument("--window-s", type=float, default=10.0, help="seconds the outer steps are counted over (default %(default)s)")
    p.add_argument("--downlink-codec", default="fp32", choices=("fp32", "bf16", "int8", "int4", "int2"),
                   help="the synchronizer's downlink codec (default %(default)s)")
    args = p.parse_args(argv)
    specs = [TensorSpec(name=f"w{i}", shape=(args.numel,), dtype="float32", role="dense") for i in range(2)]
    directory = tempfile.TemporaryDirectory(prefix="diloco-bench-kills-")
    proc, address, _ = _start(directory.name, "0", args.downlink_codec)
    port = address.rsplit(":", 1)[1]
    load = Load(address, specs, [args.numel, args.numel])
    try:
        for i, client in enumerate(load.clients):
            client.join(i, 1, specs, num_islands=ISLANDS)
        for f in range(2):
            load.clients[0].seed(0, f, 0.02 * torch.randn(args.numel, generator=torch.Generator().manual_seed(10 + f)))
        load.start()
        total_lost, lossy = 0, 0
        for k in range(args.kills):
            time.sleep(max(0.0, args.run_s - args.window_s))
            before_start = _rounds_closed(address)
            time.sleep(args.window_s)
            before = _rounds_closed(address) - before_start
            with load.lock:
                failed_before = load.failed
            _kill(proc)
            with load.lock:
                handed = dict(load.seen)
            proc, _, checkpointed = _start(directory.name, port, args.downlink_codec)
            after_start = _rounds_closed(address)
            resumed, recovery_s = _served(address, RECOVERY_WAIT + 10)
            lost = {f: max(0, handed[f] - resumed.get(f, 0)) for f in range(2)}
            with load.lock:  # versions handed out from now on are the restarted synchronizer's
                load.seen = {f: resumed.get(f, 0) for f in range(2)}
            time.sleep(max(0.0, args.window_s - recovery_s))
            after = _rounds_closed(address) - after_start
            with load.lock:
                failed = load.failed - failed_before
            total_lost += sum(lost.values())
            lossy += any(lost.values())
            print(f"kill {k + 1}: handed out {handed}, checkpoint at {checkpointed}, served at {resumed} after {recovery_s:.1f} s, "
                  f"lost {sum(lost.values())}; outer steps in {args.window_s:g} s before the kill {before}, after the restart "
                  f"{after}; failed sends {failed}", flush=True)
        print(f"{args.kills} kills: {lossy} lost versions handed out, {total_lost} in all")
    finally:
        load.close()
        _kill(proc)
        directory.cleanup()


if __name__ == "__main__":
    main()
