"""What one island's credential (or no token, on the HTTP ports) can make a synchronizer hold,
and whether honest calls are still answered meanwhile. Loopback only.

    python -m benchmarks.resources [--numel 1000000] [--max-workers 32] [--trickle 60] [--held-seeds 40]
                                   [--pulls 60] [--idle 300] [--nofile 256] [--json]

Each case starts its own synchronizer (``lightning-diloco synchronizer``, 2 fragments of
``--numel`` fp32 parameters, a run token) on 127.0.0.1, joins island 0 (the honest one, its own
credential) and seeds fragment 0, then:

- ``trickle``: island 1 opens ``--trickle`` Seed streams for the unseeded fragment 1, each sending
  its header and one byte, then nothing (a client trickling a byte every few seconds);
- ``held_seeds``: island 1 sends ``--held-seeds`` whole seeds of the already seeded fragment 0 and
  keeps each stream open;
- ``unjoined_pulls`` / ``joined_pulls``: ``--pulls`` Pulls of fragment 0 never read, with the
  credential of an island that never joined (3), then of a joined one (1);
- ``idle_http``: the synchronizer starts with a descriptor limit of ``--nofile`` (soft and hard),
  a status page and metrics port and a checkpoint after every outer step; ``--idle`` connections
  to the HTTP ports are opened and left idle; the case reports the descriptors the synchronizer
  holds, whether the honest push's checkpoint was written, and whether the page and metrics
  answer a new request then and 6 s later.

While an attack holds, the honest island's heartbeat, Status, a push of fragment 0 and a new
island's join are each given 5 s; the case reports which were answered, the synchronizer's RSS
before, at its peak during and after the attack's calls ended, and what the attacker's calls
ended with. Every wait is bounded; the attack's streams end with the case.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager

import grpc
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.fragments import TensorSpec
from lightning_diloco.core.protocol import Contribution
from lightning_diloco.synchronizer.credentials import island_credential
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport.client import SynchronizerClient
from lightning_diloco.transport.wire import chunk_messages, stub

TOKEN = "resources-benchmark-token"
HONEST_S = 5.0  # what an honest call is given, as in the adversarial review
HOLD_S = 120.0  # the longest any attack stream is held (bounded even if the case fails)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


class Synchronizer:
    """A synchronizer process on loopback, its log drained, its RSS sampled."""

    def __init__(self, numel: int, max_workers: int, nofile: int | None = None, http: bool = False) -> None:
        cmd = [sys.executable, "-m", "lightning_diloco.cli", "synchronizer", "--host", "127.0.0.1", "--port", "0",
               "--num-fragments", "2", "--min-quorum", "1", "--token", TOKEN, "--max-workers", str(max_workers)]
        self.checkpoints = tempfile.TemporaryDirectory(prefix="diloco-bench-")
        if http:  # and a checkpoint after every outer step: does one still find a descriptor?
            cmd += ["--status-port", "0", "--metrics-port", "0", "--checkpoint-dir", self.checkpoints.name, "--checkpoint-every", "1"]
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit)
        self.log: list[str] = []
        threading.Thread(target=self._drain, args=(self.proc.stderr,), daemon=True).start()
        self.address = None
        for line in self.proc.stdout:
            if line.startswith("synchronizer listening on "):
                self.address = line.split()[-1]
                break
        if self.address is None:
            raise RuntimeError(f"the synchronizer did not start: {''.join(self.log[-5:])}")
        threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()
        self.specs = [TensorSpec(name=f"w{i}", shape=(numel,), dtype="float32", role="dense") for i in range(2)]
        self.layout_hash = ""  # the run's, once the honest island has joined (case())
        self.peak = 0.0

    def _drain(self, pipe) -> None:
        for line in pipe:
            self.log.append(line)

    def port(self, what: str) -> int:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for line in self.log:
                found = re.search(rf"{what} at http://127\.0\.0\.1:(\d+)/", line)
                if found:
                    return int(found.group(1))
            time.sleep(0.05)
        raise RuntimeError(f"no {what} line in the synchronizer's log")

    def rss(self) -> float:
        return _rss_mb(self.proc.pid)

    @contextmanager
    def sampling(self):
        """Track the peak RSS while the block runs."""
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.1):
                self.peak = max(self.peak, self.rss())

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5)

    def client(self, island: int) -> SynchronizerClient:
        return SynchronizerClient(self.address, token=island_credential(TOKEN, island), max_retries=0, timeout=HONEST_S)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.checkpoints.cleanup()


def _timed(call) -> str:
    started = time.monotonic()
    try:
        call()
    except Exception as err:  # noqa: BLE001 - reported, not raised: the case goes on
        return f"failed after {time.monotonic() - started:.1f} s ({type(err).__name__}: {str(err)[:80]})"
    return f"answered in {time.monotonic() - started:.2f} s"


def honest_calls(sync: Synchronizer, honest: SynchronizerClient, numel: int, seq: list[int]) -> dict[str, str]:
    """The honest island's heartbeat, Status, a push, and a new island's join, each given 5 s."""
    seq[0] += 1
    payload = get_codec("fp32").encode(torch.zeros(numel))
    push = lambda: honest.push(Contribution(island=0, fragment=0, round=0, base_version=0, tokens=1.0, steps=1, codec="fp32",  # noqa: E731
                               seq=seq[0], payload=payload, layout_hash=sync.layout_hash))
    # a new island's join on a connection of its own, as from another process (channels in one
    # process otherwise share their connections)
    newcomer = grpc.insecure_channel(sync.address, options=[("grpc.use_local_subchannel_pool", 1)])
    specs = [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, role=s.role) for s in sync.specs]
    join = lambda: stub(newcomer).Join(pb.JoinRequest(island=2, world_size=1, tensors=specs), timeout=HONEST_S,  # noqa: E731
                                       metadata=_metadata(2))
    try:
        return {"heartbeat": _timed(lambda: honest.heartbeat(0, 1, 0.1)), "status": _timed(honest.status),
                "push": _timed(push), "join": _timed(join)}
    finally:
        newcomer.close()


def _metadata(island: int) -> tuple:
    return (("authorization", f"Bearer {island_credential(TOKEN, island)}"),)


def _outcomes(calls) -> dict[str, int]:
    """How the attacker's calls ended (or 'pending' for those still open)."""
    out: Counter[str] = Counter()
    for c in calls:
        if not c.done():
            out["pending"] += 1
            continue
        code = c.code()
        out["OK" if code == grpc.StatusCode.OK else f"{code.name}: {(c.details() or '').split(':')[0]}"] += 1
    return dict(out)


def _pull_request(fragment: int, island: int, session: str) -> pb.PullRequest:
    fields = pb.PullRequest.DESCRIPTOR.fields_by_name  # an older synchronizer's Pull names no island
    extra = {"island": island, "session": session} if "session" in fields else {}
    return pb.PullRequest(fragment=fragment, **extra)


def case(name: str, args, attack, *, http: bool = False, nofile: int | None = None) -> dict:
    sync = Synchronizer(args.numel, args.max_workers, nofile=nofile, http=http)
    honest = sync.client(0)
    release = threading.Event()
    try:
        sync.layout_hash = honest.join(0, 1, sync.specs).layout_hash  # what every push of the honest island names
        honest.seed(0, 0, torch.zeros(args.numel))
        row = {"case": name, "rss_before_mb": round(sync.rss(), 1)}
        with sync.sampling():
            calls, extra = attack(sync, release)
            row["honest"] = honest_calls(sync, honest, args.numel, [0])
            row.update(extra(sync, honest) if extra else {})
            row["attacker"] = _outcomes(calls)
            release.set()
            for c in calls:
                c.cancel()
            time.sleep(1.0)  # the server sees the cancels
        row["rss_peak_mb"] = round(sync.peak, 1)
        row["rss_after_mb"] = round(sync.rss(), 1)
        return row
    finally:
        release.set()
        honest.close()
        sync.stop()


def _seed_header(sync, fragment: int, numel: int):
    """A seed's header from island 1, in the session it joined with (the attacker holds its own
    credential and nothing more)."""
    attacker = sync.client(1)
    attacker.join(1, 1, sync.specs)
    header = pb.FragmentHeader(fragment=fragment, island=1, codec="fp32", payload_bytes=numel * 4,
                               session=attacker.sessions[0])
    attacker.close()
    return header


def trickle(args):
    def attack(sync, release):
        header = _seed_header(sync, fragment=1, numel=args.numel)

        def stream():
            yield pb.FragmentChunk(header=header, data=b"\0").SerializeToString()
            release.wait(HOLD_S)

        s = stub(grpc.insecure_channel(sync.address))
        calls = [s.Seed.future(stream(), timeout=HOLD_S, metadata=_metadata(1)) for _ in range(args.trickle)]
        time.sleep(2.0)  # the streams reach their handlers
        return calls, None

    return attack


def held_seeds(args):
    def attack(sync, release):
        header = _seed_header(sync, fragment=0, numel=args.numel)
        payload = get_codec("fp32").encode(torch.ones(args.numel))

        def stream():
            yield from chunk_messages(header, payload)
            release.wait(HOLD_S)  # the whole payload sent, the stream held open

        s = stub(grpc.insecure_channel(sync.address))
        calls = [s.Seed.future(stream(), timeout=HOLD_S, metadata=_metadata(1)) for _ in range(args.held_seeds)]
        _settle(sync)
        return calls, lambda sync, honest: {"rss_held_mb": round(sync.rss(), 1)}

    return attack


def pulls(args, joined: bool):
    def attack(sync, release):
        island = 1 if joined else 3
        session = ""
        if joined:
            attacker = sync.client(1)
            attacker.join(1, 1, sync.specs)
            session = attacker.sessions[0]
            attacker.close()
        # a client that never widens its receive window: the replies stay in the synchronizer's buffers
        s = stub(grpc.insecure_channel(sync.address, options=[("grpc.http2.bdp_probe", 0)]))
        request = _pull_request(0, island, session)
        calls = [s.Pull(request, timeout=HOLD_S, metadata=_metadata(island)) for _ in range(args.pulls)]
        _settle(sync)
        return calls, lambda sync, honest: {"rss_held_mb": round(sync.rss(), 1)}

    return attack


def idle_http(args):
    def attack(sync, release):
        ports = [sync.port("status page"), sync.port("metrics")]
        sockets, failed, in_a_row = [], 0, 0
        for i in range(args.idle):
            try:  # a synchronizer out of descriptors accepts nothing: its listen queue fills, connects wait
                sockets.append(socket.create_connection(("127.0.0.1", ports[i % 2]), timeout=2))
                in_a_row = 0
            except OSError:
                failed, in_a_row = failed + 1, in_a_row + 1
                if in_a_row >= 4:
                    break
        time.sleep(1.0)  # accepted (or closed) by the synchronizer

        def extra(sync, honest):
            closed = sum(1 for s in sockets if _closed_by_peer(s))
            return {"idle_opened": len(sockets), "idle_refused_at_connect": failed, "idle_closed_at_once": closed,
                    "descriptors_in_use": len(os.listdir(f"/proc/{sync.proc.pid}/fd")),
                    "checkpoint": _checkpoint(honest),
                    "page": _timed(lambda: _get(ports[0])), "metrics": _timed(lambda: _get(ports[1], "/metrics")),
                    "page_6s_later": _later(6.0, lambda: _get(ports[0])),  # past an idle timeout of 5 s
                    "descriptor_errors_in_log": sum("Too many open files" in line or "EMFILE" in line for line in sync.log)}

        calls = _Sockets(sockets)
        return [calls], extra

    return attack


class _Sockets:
    """The idle connections, ended like the other attacks' calls."""

    def __init__(self, sockets) -> None:
        self.sockets = sockets

    def done(self) -> bool:
        return True

    def code(self):
        return grpc.StatusCode.OK

    def details(self) -> str:
        return ""

    def cancel(self) -> None:
        for s in self.sockets:
            s.close()


def _closed_by_peer(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def _later(seconds: float, call) -> str:
    time.sleep(seconds)
    return _timed(call)


def _checkpoint(honest: SynchronizerClient, limit_s: float = 15.0) -> str:
    """How the checkpoint after the honest push's round went, as Status tells."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            st = honest.status()
        except Exception as err:  # noqa: BLE001 - reported
            return f"no status ({type(err).__name__})"
        if st.checkpoint_failures:
            return f"failed {st.checkpoint_failures}x: {st.last_checkpoint_error[:80]}"
        if st.last_checkpoint_outer_steps >= 1:
            return "written"
        time.sleep(0.2)
    return f"none within {limit_s:.0f} s"


def _get(port: int, path: str = "/") -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=HONEST_S) as reply:
        reply.read()


def _settle(sync: Synchronizer, quiet_s: float = 2.0, limit_s: float = 60.0) -> None:
    """Wait until the synchronizer's RSS stops growing (what the attack makes it hold is held)."""
    deadline = time.monotonic() + limit_s
    last, since = sync.rss(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.2)
        now = sync.rss()
        if now > last + 1:
            last, since = now, time.monotonic()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1_000_000, help="parameters per fragment (default %(default)s: 4 MB)")
    parser.add_argument("--max-workers", type=int, default=32, help="the synchronizer's --max-workers (default %(default)s)")
    parser.add_argument("--trickle", type=int, default=60, help="trickling seed streams (default %(default)s)")
    parser.add_argument("--held-seeds", type=int, default=40, help="whole seeds of a seeded fragment, held (default %(default)s)")
    parser.add_argument("--pulls", type=int, default=60, help="pulls never read (default %(default)s)")
    parser.add_argument("--idle", type=int, default=300, help="idle HTTP connections (default %(default)s)")
    parser.add_argument("--nofile", type=int, default=256, help="the synchronizer's descriptor limit (default %(default)s)")
    parser.add_argument("--cases", nargs="*", default=["trickle", "held_seeds", "unjoined_pulls", "joined_pulls", "idle_http"],
                        help="which attacks (default: all)")
    parser.add_argument("--json", action="store_true", help="one JSON line per case")
    args = parser.parse_args(argv)
    attacks = {"trickle": lambda: case("trickle", args, trickle(args)),
               "held_seeds": lambda: case("held_seeds", args, held_seeds(args)),
               "unjoined_pulls": lambda: case("unjoined_pulls", args, pulls(args, joined=False)),
               "joined_pulls": lambda: case("joined_pulls", args, pulls(args, joined=True)),
               "idle_http": lambda: case("idle_http", args, idle_http(args), http=True, nofile=args.nofile)}
    for name in args.cases:
        row = attacks[name]()
        print(json.dumps(row) if args.json else "\n".join([f"== {name}"] + [f"  {k}: {v}" for k, v in row.items() if k != "case"]),
              flush=True)


if __name__ == "__main__":
    main()
