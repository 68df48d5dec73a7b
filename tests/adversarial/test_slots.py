"""A live island's slot cannot be taken, and what one island states at join cannot refuse another
island's join (the run's identity is the operator's: --num-islands, or a quorum of islands)."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import Contribution
from lightning_diloco.synchronizer.credentials import island_credential
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport import synchronizer_pb2_grpc as pb_grpc
from lightning_diloco.transport.client import SynchronizerClient
from tests.helpers import SPECS, initial_fragments, layout, run_config, wait_for_version

TOKEN = "run-secret"
TENSORS = [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, role=s.role) for s in SPECS]


class Clock:
    """The synchronizer's clock: real time, plus what the test skips (an old process's silence)."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skipped


def _raw_join(stub, metadata, island: int, **fields):
    """A join as a client of any version may send it: ``previous_session`` left out unless given."""
    return stub.Join(pb.JoinRequest(island=island, world_size=1, tensors=TENSORS, **fields), metadata=metadata, timeout=10)


def _push(client, config, seq: int, round: int):
    numel = layout(config).fragment_numel(0)
    return client.push(Contribution(island=0, fragment=0, round=round, base_version=0, tokens=100.0, steps=4, codec="fp32",
                                    seq=seq, payload=get_codec("fp32").encode(torch.full((numel,), 1e-3)),
                                    layout_hash=layout(config).hash))


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "run-token"])
def test_a_join_without_a_previous_session_cannot_take_a_live_islands_slot(token):
    config = run_config(num_fragments=2, min_quorum=1)
    clock = Clock()
    server = SynchronizerServer(Synchronizer(config, SynchronizerSettings(clock=clock)), token=token).start()
    honest = SynchronizerClient(server.address, token=token, max_retries=1, backoff=0.05)
    channel = grpc.insecure_channel(server.address)
    stub, metadata = pb_grpc.SynchronizerStub(channel), ([("authorization", f"Bearer {token}")] if token else [])
    restarted = None
    try:
        honest.join(0, 1, SPECS)
        for p, value in initial_fragments(config).items():
            honest.seed(0, p, value)
        honest.heartbeat(0, 1, 0.01)
        session = server.service.membership.members[0].session
        for fields in ({}, {"previous_session": ""}, {"previous_session": "not-a-session"}):  # the "older client" path first
            with pytest.raises(grpc.RpcError) as err:
                _raw_join(stub, metadata, 0, **fields)
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value.details()
            assert err.value.details().startswith("island_running"), err.value.details()
        assert server.service.membership.members[0].session == session  # the honest island's session stands
        version = 0
        for seq in range(1, 4):  # and every send of it applies
            honest.heartbeat(0, seq * 4, 0.01, schedule_step=seq * 4)
            ack = _push(honest, config, seq, round=max(0, server.service.status().rounds[0].round))
            assert not ack.duplicate
            version = wait_for_version(honest.pull, 0, version + 1, timeout=10)[0]
        # the honest island is killed (silent, no leave) and restarted: a new process, no session
        # to present, let in once the old one has been silent past the running window
        honest.close()
        clock.skipped = server.service.membership.running_window + 1
        restarted = SynchronizerClient(server.address, token=token, max_retries=1, backoff=0.05)
        restarted.join(0, 1, SPECS)
        assert server.service.membership.members[0].session not in ("", session)
        assert restarted.heartbeat(0, 20, 0.01).versions[0] == version
    finally:
        for client in (honest, restarted):
            if client is not None:
                client.close()
        channel.close()
        server.stop(grace=0)


def test_one_islands_count_cannot_lock_the_others_out(tmp_path):
    """Island 3 says 10000 first, island 0 says 1: neither count is the run's. The run's is the
    one a quorum of its islands says (3 of 4 here), kept across a restart, and refuses only the
    islands that said another."""
    config = run_config(num_fragments=2, min_quorum=1)

    def served():
        return SynchronizerServer(Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path)), token=TOKEN).start()

    def join(stub, island: int, count: int):
        md = [("authorization", f"Bearer {island_credential(TOKEN, island)}")]  # each with its own credential
        return _raw_join(stub, md, island, num_islands=count, previous_session="")

    server = served()
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.SynchronizerStub(channel)
        join(stub, 3, 10000)  # the squat: first to say a count
        join(stub, 0, 1)  # and one that would leave only itself in the run
        for island in (1, 2):  # the islands started with 4 are all let in
            join(stub, island, 4)
        assert server.service.run.num_islands == 0  # 2 of 4 say 4: no quorum yet, and no count refuses anyone
        channel.close()
        server.stop(grace=0)
        server = served()  # a restart keeps the count the quorum agreed on (none yet: not the squat)
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.SynchronizerStub(channel)
        for island in range(4):
            join(stub, island, 4)
        assert server.service.run.num_islands == 4
        with pytest.raises(grpc.RpcError) as err:  # now the squatter's own join is what is refused
            join(stub, 3, 10000)
        assert err.value.details().startswith("num_islands_mismatch"), err.value.details()
    finally:
        channel.close()
        server.stop(grace=0)
