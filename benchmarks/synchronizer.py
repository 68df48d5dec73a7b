"""Synchronizer throughput on loopback: one shard in its own process, learners as threads.

    python -m benchmarks.synchronizer [--learners 1 4 16 64] [--sizes 1000000 16000000] [--codec bf16]

Every round waits for all M learners (K = M, no grace), so a round's latency is the time from
the first push to the new version's arrival through the learners' subscriptions (the downlink
in the same codec). Prints contributions/s, MB/s of payload ingested and round latency per
(M, fragment size), and the ratio of each M against M = 1 measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.fragments import TensorSpec
from lightning_diloco.transport.client import SynchronizerClient


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
                    clients[i].push(island=i, fragment=0, round=r, base_version=r, tokens=1.0, steps=1, codec=codec_name,
                                    seq=r, payload=payload, layout_hash=info.layout_hash)
                    with arrived[i]:
                        if not arrived[i].wait_for(lambda: versions[i] > r, timeout=600):
                            raise TimeoutError(f"learner {i}: no version {r + 1} within 600 s")
                    if i == 0:
                        latencies.append(time.perf_counter() - start)
            except BaseException as err:  # reported after the join
                errors.append(err)
                barrier.abort()

        threads = [threading.Thread(target=learner, args=(i,), name=f"diloco-bench-{i}") for i in range(learners)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        if errors:
            raise errors[0]
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
        proc.terminate()
        proc.wait(timeout=60)
        proc.stdout.close()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 16_000_000], help="fragment sizes in parameters")
    parser.add_argument("--codec", default="bf16", help="payload codec (default %(default)s)")
    parser.add_argument("--budget-mb", type=float, default=4000, help="payload MB per case; sets the rounds (1 to 20)")
    args = parser.parse_args(argv)

    rows = []
    print(f"synchronizer benchmark: one shard on loopback, {args.codec} payloads, {os.cpu_count()} cores")
    print(f"{'learners':>8} {'params':>11} {'rounds':>6} {'contrib/s':>10} {'MB/s in':>9} {'round s':>8} {'MB/s vs M=1':>12}")
    for numel in args.sizes:
        base = None
        for m in args.learners:
            size_mb = get_codec(args.codec).encoded_size(numel) / 1e6
            rounds = int(max(1, min(20, args.budget_mb // max(size_mb * m, 1e-9))))
            row = run_case(m, numel, rounds, args.codec)
            base = base or row
            row["mb_per_s_vs_one"] = row["mb_per_s"] / base["mb_per_s"]
            rows.append(row)
            print(f"{m:>8} {numel:>11,} {rounds:>6} {row['contrib_per_s']:>10.1f} {row['mb_per_s']:>9.1f} "
                  f"{row['round_latency_s']:>8.3f} {row['mb_per_s_vs_one']:>12.2f}", flush=True)
    return rows


if __name__ == "__main__":
    main()
