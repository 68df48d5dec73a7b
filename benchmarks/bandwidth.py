"""Bytes crossing island boundaries per training token: Decoupled DiLoCo against DDP, measured on
network links, with the quality cost from the same run.

    python -m benchmarks.bandwidth [--islands 4] [--steps 400]

Each island (each DDP rank) runs in its own network namespace joined to the root namespace by a
veth link; the synchronizer listens in the root namespace. The bytes are the links' interface
counters (TCP/IP headers, HTTP/2 and gRPC framing, heartbeats included) over each unit's
steady-state window (from its step 10 to 2 steps before its end: joins and final pulls excluded;
the totals with them are printed too). Arms: DDP (fp32 gradient all-reduce over gloo), and Decoupled DiLoCo
at the paper's defaults (P = 24, H = 24, int4 uplink, bf16 downlink), with an int4 downlink, at
H = 100, with int2 both ways (blocks of 64 and 128), and ``presets.low_bandwidth()`` (int2 both ways in
blocks of 128 at outer lr 0.5), and ``presets.sparse()`` (chunked top-k at densities 1/64 and 1/128, and at 1/64 with the output head in int2), and a sparse uplink at 1/8 with the head in int2 and int4 down; quorum 1 (the library's) and apply mix, the recipes' CPU setting. Needs root; prints why and exits 0 where namespaces are not available.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.netns import Namespaces, unavailable
from benchmarks.netrun import run_arm
from lightning_diloco.core import presets
from lightning_diloco.core.settings import changed_settings, config_with, setting_flags

ARMS = {
    "diloco H=24 int4 up / bf16 down": ["--sync-every=24", "--uplink-codec=int4", "--downlink-codec=bf16"],
    "diloco H=24 int4 up / int4 down": ["--sync-every=24", "--uplink-codec=int4", "--downlink-codec=int4"],
    "diloco H=100 int4 up / int4 down": ["--sync-every=100", "--uplink-codec=int4", "--downlink-codec=int4"],
    "diloco H=24 int2 up / int2 down, blocks of 64": ["--sync-every=24", "--uplink-codec=int2", "--downlink-codec=int2"],
    "diloco H=24 int2 up / int2 down, blocks of 128": ["--sync-every=24", "--uplink-codec=int2", "--downlink-codec=int2",
                                                      "--block-size=128"],
    # int2 both ways, blocks of 128, outer lr 0.5: what held quality within 1% over 3 seeds (RESULTS.md)
    "diloco H=24 presets.low_bandwidth()": ["--sync-every=24", *setting_flags(changed_settings(presets.low_bandwidth()))],
    # SparseLoCo's chunked top-k both ways, error feedback both ways (core/sparse_codec.py)
    "diloco H=24 presets.sparse() 1/64": ["--sync-every=24", *setting_flags(changed_settings(presets.sparse()))],
    "diloco H=24 presets.sparse() 1/128": ["--sync-every=24", *setting_flags(changed_settings(presets.sparse(density=1 / 128)))],
    # the same with the output head's fragment in int2 both ways (sparse_dense_tensors)
    "diloco H=24 presets.sparse() 1/64, head int2": [
        "--sync-every=24", *setting_flags(changed_settings(presets.sparse(dense_tensors="*lm_head.weight")))],
    # the density sweep's point (within 0.5 points of int4, simulated): a sparse uplink at 1/8 with
    # the head in int2, int4 down (its residual in the parameters, which apply mix refuses, moves no byte)
    "diloco H=24 sparse 1/8 up, head int2 / int4 down": ["--sync-every=24", *setting_flags(changed_settings(config_with(
        {"uplink_codec": "sparse", "sparse_density": 1 / 8, "sparse_dense_tensors": "*lm_head.weight",
         "downlink_codec": "int4"})))],
}


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--islands", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=3, help="3 layers: 30 tensors, enough for P = 24")
    p.add_argument("--num-fragments", type=int, default=24)
    p.add_argument("--only", action="append", default=[], help="run only the DiLoCo arms whose name contains this")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"bandwidth benchmark skipped: {why}")
        return None
    batch, seq, vocab = 16, 32, 256
    train = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(vocab), "--seq", str(seq),
             "--batch", str(batch)]
    # the recipes' CPU setting: the library's quorum 1, islands mixing the global fragment in
    common_sync = setting_flags(changed_settings(presets.small_model(args.num_fragments)))
    arms = {k: v for k, v in ARMS.items() if not args.only or any(s in k for s in args.only)}
    results = {}
    with tempfile.TemporaryDirectory(prefix="diloco-bandwidth-") as tmp, Namespaces(args.islands) as ns:
        results["ddp"] = run_arm(ns, True, train, [], Path(tmp) / "ddp", batch * seq, args.steps)
        for i, (name, flags) in enumerate(arms.items()):
            results[name] = run_arm(ns, False, train, common_sync + flags, Path(tmp) / f"diloco-{i}", batch * seq, args.steps)
    ddp = results["ddp"]
    print(f"bandwidth: {args.islands} islands / DDP ranks, {args.steps} steps, hidden {args.hidden} x {args.layers} layers, "
          f"P = {args.num_fragments}; bytes on the links per training token (steady state)")
    print(f"{'arm':<34} {'B/token':>9} {'reduction':>10} {'total MB':>9} {'val loss':>9} {'vs DDP':>7}")
    summary = {}
    for name, r in results.items():
        reduction = ddp.bytes_per_token / r.bytes_per_token
        gap = (r.val_loss - ddp.val_loss) / ddp.val_loss
        summary[name] = {"bytes_per_token": r.bytes_per_token, "reduction": reduction, "total_bytes": r.wire_bytes,
                         "val_loss": r.val_loss, "quality_gap": gap}
        print(f"{name:<34} {r.bytes_per_token:>9.1f} {reduction:>9.1f}x {r.wire_bytes / 1e6:>9.2f} {r.val_loss:>9.4f} "
              f"{gap * 100:>+6.1f}%")
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
