"""Codec throughput, size and error against fp32.

    python -m benchmarks.codec [--numel 16777216] [--repeats 5]

For each codec: bytes per parameter, encode+decode throughput in GB/s of fp32 input, relative
RMS error on Gaussian data, and the size and speed ratios against fp32 measured in the same run.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from lightning_diloco.core.codecs import get_codec

CODECS = ("fp32", "bf16", "int8", "int4", "int2", "sparse")


def measure(name: str, x: torch.Tensor, repeats: int, block_size: int, density: float) -> dict:
    codec = get_codec(name, block_size, density)
    data = codec.encode(x)  # warm-up, and the sample for the error
    out = codec.decode(data, x.numel())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        codec.decode(codec.encode(x), x.numel())
        best = min(best, time.perf_counter() - start)
    return {
        "codec": name,
        "bytes_per_param": len(data) / x.numel(),
        "gb_per_s": x.numel() * 4 / best / 1e9,
        "rel_rms_error": float((x - out).norm() / x.norm()),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 24, help="values in the test tensor (default 16M)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the best is reported (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=64, help="values per scale for int8/int4/int2 (default %(default)s)")
    parser.add_argument("--sparse-density", type=float, default=1 / 64,
                        help="share of values the sparse codec sends (default 1/64); its error is of one message, without feedback")
    args = parser.parse_args(argv)

    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    rows = [measure(name, x, args.repeats, args.block_size, args.sparse_density) for name in CODECS]
    base = rows[0]
    print(f"codec benchmark: {args.numel:,} Gaussian values, block {args.block_size}, sparse density {args.sparse_density:g}, "
          f"{torch.get_num_threads()} threads, {platform.machine()}")
    print(f"{'codec':<6} {'B/param':>8} {'size vs fp32':>12} {'GB/s':>7} {'speed vs fp32':>13} {'rel RMS err':>12}")
    for row in rows:
        row["size_ratio"] = row["bytes_per_param"] / base["bytes_per_param"]
        row["speed_ratio"] = row["gb_per_s"] / base["gb_per_s"]
        print(f"{row['codec']:<6} {row['bytes_per_param']:>8.4f} {row['size_ratio']:>12.4f} {row['gb_per_s']:>7.2f} "
              f"{row['speed_ratio']:>13.3f} {row['rel_rms_error']:>12.2e}")
    return rows


if __name__ == "__main__":
    main()
