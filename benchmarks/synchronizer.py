"""Synchronizer throughput on loopback: one shard in its own process, learners as threads.

    python -m benchmarks.synchronizer [--learners 1 4 16 64] [--sizes 1000000 16000000] [--codec bf16]
                                      [--budget-mb MB] [--max-rounds N] [--plain] [--json]

Every round waits for all M learners (K = M, no grace), so a round's latency is the time from
the first push to the new version's arrival through the learners' subscriptions (the downlink
in the same codec). Prints contributions/s, MB/s of payload ingested and round latency per
(M, fragment size), and the ratio of each M against M = 1 measured in the same run.

``--plain``: also plain gRPC streaming of the same bytes, in the same run: each of M threads
streams its payload to a bare gRPC server in another process (raw bytes, no protobuf, 3 MiB
messages), which streams it straight back, so as many bytes go in and out as in a round. Its
MB/s in is the ceiling Python gRPC sets on this machine; ``vs plain`` is the shard's share of it.
The learner side keeps freed memory (synchronizer.main.keep_freed_memory) so that its receive
buffers cost it no page faults that the synchronizer's figure would pay for. ``--json``: the
rows as JSON on stdout, nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.fragments import TensorSpec
from lightning_diloco.core.protocol import Contribution
from lightning_diloco.synchronizer.main import keep_freed_memory
from lightning_diloco.transport.client import SynchronizerClient

PLAIN_CHUNK = 3 << 20
PLAIN_METHOD = "/bench.Plain/Echo"



def timed_threads(learner, learners: int, errors: list) -> float:
    """Seconds for ``learners`` threads running ``learner(i)``; the first error they recorded is raised."""
    threads = [threading.Thread(target=learner, args=(i,), name=f"diloco-bench-{i}") for i in range(learners)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def _stop(proc: subprocess.Popen) -> None:
    """Stop a server the benchmark started and close its pipe."""
    proc.terminate()
    proc.wait(timeout=60)
    proc.stdout.close()

def _start_server(min_quorum: int, codec: str) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable, "-m", "lightning_diloco.cli", "synchronizer", "--port", "0",
        "--num-fragments", "1", "--sync-every", "1", "--overlap-steps", "0", "--min-quorum", str(min_quorum),
        "--grace-gamma", "0", "--uplink-codec", codec, "--downlink-codec", codec, "--history", "2",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("synchronizer listening on "):
            return proc, line.split()[-1]
    raise RuntimeError(f"synchronizer failed to start (exit {proc.wait()})")


def run_case(learners: int, numel: int, rounds: int, codec_name: str) -> dict:
    proc, address = _start_server(learners, codec_name)
    specs = [TensorSpec(name="w", shape=(numel,), dtype="float32", role="dense")]
    codec = get_codec(codec_name)
    clients = [SynchronizerClient(address, timeout=600) for _ in range(learners)]
    try:
        info = clients[0].join(0, 1, specs)
        clients[0].seed(0, 0, torch.zeros(numel))
        for i in range(1, learners):
            clients[i].join(i, 1, specs)
        arrived = [threading.Condition() for _ in range(learners)]
        versions = [0] * learners

        def on_version(i, event):
            with arrived[i]:
                versions[i] = event.version
                arrived[i].notify_all()

        for i, client in enumerate(clients):
            client.subscribe(i, lambda i=i: {0: versions[i]}, on_request=lambda *_: None,
                             on_version=lambda event, i=i: on_version(i, event))
        payload = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3)
        latencies: list[float] = []
        barrier = threading.Barrier(learners)
        errors: list[BaseException] = []

        def learner(i: int) -> None:
            try:
                for r in range(rounds):
                    barrier.wait()
                    start = time.perf_counter()
                    clients[i].push(Contribution(island=i, fragment=0, round=r, base_version=r, tokens=1.0, steps=1, codec=codec_name,
                                    seq=r, payload=payload, layout_hash=info.layout_hash))
                    with arrived[i]:
                        if not arrived[i].wait_for(lambda: versions[i] > r, timeout=600):  # noqa: B023 - called within this iteration
                            raise TimeoutError(f"learner {i}: no version {r + 1} within 600 s")
                    if i == 0:
                        latencies.append(time.perf_counter() - start)
            except BaseException as err:  # reported after the join
                errors.append(err)
                barrier.abort()

        elapsed = timed_threads(learner, learners, errors)
        contributions = learners * rounds
        return {
            "learners": learners,
            "numel": numel,
            "rounds": rounds,
            "contrib_per_s": contributions / elapsed,
            "mb_per_s": contributions * payload.numel() / elapsed / 1e6,
            "round_latency_s": sum(latencies) / len(latencies),
        }
    finally:
        for c in clients:
            c.close()
        _stop(proc)


def _plain_server() -> None:
    """A bare gRPC server that streams every request message straight back (--plain-server)."""
    from concurrent import futures

    import grpc

    def echo(requests, context):
        yield from requests

    handler = grpc.method_handlers_generic_handler("bench.Plain", {"Echo": grpc.stream_stream_rpc_method_handler(echo)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=256), handlers=(handler,),
                         options=[("grpc.max_receive_message_length", 4 * PLAIN_CHUNK), ("grpc.max_send_message_length", 4 * PLAIN_CHUNK)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"plain listening on 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


def run_plain(learners: int, payload_bytes: int, rounds: int) -> float:
    """MB/s in of plain gRPC streaming: M threads each send ``payload_bytes`` per round and read
    them back, rounds in step (a barrier), as in the synchronizer's rounds."""
    import grpc

    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.synchronizer", "--plain-server"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    address = proc.stdout.readline().split()[-1]
    options = [("grpc.max_receive_message_length", 4 * PLAIN_CHUNK), ("grpc.max_send_message_length", 4 * PLAIN_CHUNK)]
    channels = [grpc.insecure_channel(address, options) for _ in range(learners)]
    payload = os.urandom(payload_bytes)
    barrier, errors = threading.Barrier(learners), []

    def learner(i: int) -> None:
        echo = channels[i].stream_stream(PLAIN_METHOD)
        try:
            for _ in range(rounds):
                barrier.wait()
                chunks = (payload[s : s + PLAIN_CHUNK] for s in range(0, payload_bytes, PLAIN_CHUNK))
                received = sum(len(m) for m in echo(chunks, timeout=600))
                assert received == payload_bytes, (received, payload_bytes)
        except BaseException as err:  # reported after the join
            errors.append(err)
            barrier.abort()

    try:
        elapsed = timed_threads(learner, learners, errors)
        return learners * rounds * payload_bytes / elapsed / 1e6
    finally:
        for c in channels:
            c.close()
        _stop(proc)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 16_000_000], help="fragment sizes in parameters")
    parser.add_argument("--codec", default="bf16", help="payload codec (default %(default)s)")
    parser.add_argument("--budget-mb", type=float, default=4000, help="payload MB per case; sets the rounds (1 to --max-rounds)")
    parser.add_argument("--max-rounds", type=int, default=20, help="at most this many rounds per case (default %(default)s)")
    parser.add_argument("--plain", action="store_true", help="also measure plain gRPC streaming of the same bytes")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON only")
    parser.add_argument("--plain-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_server:
        _plain_server()
        return []
    say = (lambda *a, **k: None) if args.json else print

    rows = []
    say(f"synchronizer benchmark: one shard on loopback, {args.codec} payloads, {os.cpu_count()} cores")
    say(f"{'learners':>8} {'params':>11} {'rounds':>6} {'contrib/s':>10} {'MB/s in':>9} {'round s':>8} {'MB/s vs M=1':>12}"
        + (f" {'plain MB/s':>10} {'vs plain':>8}" if args.plain else ""))
    for numel in args.sizes:
        base = None
        for m in args.learners:
            size = get_codec(args.codec).encoded_size(numel)
            rounds = int(max(1, min(args.max_rounds, args.budget_mb // max(size / 1e6 * m, 1e-9))))
            row = run_case(m, numel, rounds, args.codec)
            base = base or row
            row["mb_per_s_vs_one"] = row["mb_per_s"] / base["mb_per_s"]
            if args.plain:
                row["plain_mb_per_s"] = run_plain(m, size, rounds)
                row["vs_plain"] = row["mb_per_s"] / row["plain_mb_per_s"]
            rows.append(row)
            say(f"{m:>8} {numel:>11,} {rounds:>6} {row['contrib_per_s']:>10.1f} {row['mb_per_s']:>9.1f} "
                f"{row['round_latency_s']:>8.3f} {row['mb_per_s_vs_one']:>12.2f}"
                + (f" {row['plain_mb_per_s']:>10.1f} {row['vs_plain']:>8.2f}" if args.plain else ""), flush=True)
    if args.json:
        print(json.dumps({"codec": args.codec, "cores": os.cpu_count(), "rows": rows}))
    return rows


if __name__ == "__main__":
    keep_freed_memory()
    main()
