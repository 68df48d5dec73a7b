"""A tiny layout, its parameters, contributions against it and a clock that moves when told: what
the benchmarks that drive the real synchronizer in-process (arena.py) and the tests share.

Here rather than in tests/helpers.py (which re-exports them) so that benchmarks/ never imports
tests/."""

from __future__ import annotations

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.fragments import DENSE, EMBEDDING, TensorSpec, build_layout
from lightning_diloco.core.protocol import Contribution

SPECS = [
    TensorSpec(name="embed.weight", shape=(16, 4), dtype="float32", role=EMBEDDING),
    TensorSpec(name="layer.weight", shape=(8, 4), dtype="float32", role=DENSE),
    TensorSpec(name="layer.bias", shape=(8,), dtype="float32", role=DENSE),
    TensorSpec(name="head.weight", shape=(4, 8), dtype="float32", role=DENSE),
]


def layout(config):
    return build_layout(SPECS, config.schedule.num_fragments)


def initial_fragments(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = layout(config)
    return {p: torch.randn(lay.fragment_numel(p), generator=g) for p in range(lay.num_fragments)}


def contribution(config, island, fragment, delta, *, round=0, base_version=0, seq=0, tokens=100.0, steps=4, codec="fp32",
                 layout_hash=None):
    return Contribution(
        island=island,
        fragment=fragment,
        round=round,
        base_version=base_version,
        tokens=tokens,
        steps=steps,
        codec=codec,
        seq=seq,
        payload=get_codec(codec).encode(delta),
        layout_hash=layout_hash or layout(config).hash,
    )


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
