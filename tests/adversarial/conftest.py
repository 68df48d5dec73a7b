"""A real synchronizer on port 0 and helpers to attack it the way a hostile or buggy client would."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import Contribution
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport import synchronizer_pb2_grpc as pb_grpc
from lightning_diloco.transport.client import SynchronizerClient
from tests.helpers import SPECS, initial_fragments, layout, run_config, wait_for_version


@dataclass
class Target:
    server: SynchronizerServer
    honest: SynchronizerClient
    config: object

    @property
    def service(self) -> Synchronizer:
        return self.server.service

    def snapshot(self) -> dict[int, torch.Tensor]:
        return {p: f.value.clone() for p, f in self.service.run.state.fragments.items()}

    def stub(self) -> pb_grpc.SynchronizerStub:
        return pb_grpc.SynchronizerStub(self.channel)

    def push(self, client, island, fragment, delta, *, round=0, base_version=0, seq=0, tokens=100.0, steps=4, codec="int4"):
        return client.push(Contribution(island=island, fragment=fragment, round=round, base_version=base_version, tokens=tokens,
                           steps=steps, codec=codec, seq=seq, payload=get_codec(codec).encode(delta),
                           layout_hash=layout(self.config).hash))

    def settle(self, fragment: int, version: int) -> None:
        wait_for_version(self.honest.pull, fragment, version, timeout=10)

    def answers_status_promptly(self) -> None:
        started = time.monotonic()
        self.honest.status()
        assert time.monotonic() - started < 1.0, "Status took over a second"


def all_finite(state: dict[int, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values())


@pytest.fixture
def target():
    config = run_config(num_fragments=2, min_quorum=1, uplink="int4", downlink="bf16")
    server = SynchronizerServer(Synchronizer(config), max_workers=24).start()
    honest = SynchronizerClient(server.address, max_retries=1, backoff=0.05)
    honest.join(0, 1, SPECS)
    for p, value in initial_fragments(config).items():
        honest.seed(0, p, value)
    # its step time, as a training island's heartbeat says it: an entry alone in a fragment's first
    # round waits H step times (40 ms) for another island's, not the 10 s used before any is known
    honest.heartbeat(0, 1, 0.01)
    t = Target(server, honest, config)
    t.channel = grpc.insecure_channel(server.address)
    yield t
    t.channel.close()
    honest.close()
    server.stop(grace=0)


def header(config, **fields) -> pb.PushHeader:
    numel = layout(config).fragment_numel(0)
    base = dict(island=0, fragment=0, round=0, base_version=0, tokens=100.0, steps=4, codec="fp32", seq=1,
                layout_hash=layout(config).hash, payload_bytes=numel * 4)
    return pb.PushHeader(**{**base, **fields})
