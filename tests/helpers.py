"""Small shared test fixtures: a tiny layout, its parameters, and contributions against it."""

from __future__ import annotations

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.config import CodecConfig, MergeConfig, OuterConfig, RunConfig, ScheduleConfig
from lightning_diloco.core.fragments import DENSE, EMBEDDING, TensorSpec, build_layout
from lightning_diloco.synchronizer.service import Contribution

SPECS = [
    TensorSpec(name="embed.weight", shape=(16, 4), dtype="float32", role=EMBEDDING),
    TensorSpec(name="layer.weight", shape=(8, 4), dtype="float32", role=DENSE),
    TensorSpec(name="layer.bias", shape=(8,), dtype="float32", role=DENSE),
    TensorSpec(name="head.weight", shape=(4, 8), dtype="float32", role=DENSE),
]


def run_config(num_fragments=2, min_quorum=1, gamma=0.0, overlap=1, uplink="fp32", downlink="fp32", history=4, **merge):
    return RunConfig(
        schedule=ScheduleConfig(num_fragments=num_fragments, sync_every=4, overlap_steps=overlap),
        merge=MergeConfig(min_quorum=min_quorum, grace_gamma=gamma, history=history, **merge),
        outer=OuterConfig(lr=0.7, momentum=0.9),
        codec=CodecConfig(uplink=uplink, downlink=downlink),
    )


def layout(config):
    return build_layout(SPECS, config.schedule.num_fragments)


def initial_fragments(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    lay = layout(config)
    return {p: torch.randn(lay.fragment_numel(p), generator=g) for p in range(lay.num_fragments)}


def contribution(config, island, fragment, delta, *, base_version=0, seq=0, tokens=100.0, steps=4, codec="fp32", layout_hash=None):
    return Contribution(
        island=island,
        fragment=fragment,
        base_version=base_version,
        tokens=tokens,
        steps=steps,
        codec=codec,
        seq=seq,
        payload=get_codec(codec).encode(delta),
        layout_hash=layout_hash or layout(config).hash,
    )
