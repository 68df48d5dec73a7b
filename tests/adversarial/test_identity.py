"""A client can act only as the island its credential names, and a session's sequence numbers
cannot lock out the island's later sessions."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from lightning_diloco.core.protocol import Contribution
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.credentials import identify, island_credential
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport.client import SynchronizerClient, SynchronizerError
from tests.adversarial.conftest import all_finite
from tests.helpers import SPECS, initial_fragments, layout, run_config, wait_for_version

TOKEN = "run-secret"


def _client(address, token):
    return SynchronizerClient(address, token=token, max_retries=0, backoff=0.05)


@pytest.fixture
def guarded():
    config = run_config(num_fragments=2, min_quorum=1)
    server = SynchronizerServer(Synchronizer(config), token=TOKEN).start()
    operator = _client(server.address, TOKEN)  # the run token: the operator's key, any island
    operator.join(0, 1, SPECS)
    for p, value in initial_fragments(config).items():
        operator.seed(0, p, value)
    yield server, config
    operator.close()
    server.stop(grace=0)


def _push(client, config, island, seq, value=1e-3, round=0):
    numel = layout(config).fragment_numel(0)
    from lightning_diloco.core.codecs import get_codec

    return client.push(Contribution(island=island, fragment=0, round=round, base_version=0, tokens=100.0, steps=4, codec="fp32", seq=seq,
                       payload=get_codec("fp32").encode(torch.full((numel,), value)), layout_hash=layout(config).hash))


def test_a_credential_is_bound_to_its_island_and_cannot_be_forged():
    one = island_credential(TOKEN, 1)
    assert identify(TOKEN, one).island == 1 and identify(TOKEN, TOKEN).island is None
    head, mac = one.split(".")
    for forged in ("island-0." + mac, one + "0", "island-1", "island-1.", "island-x." + mac, island_credential("other", 1), ""):
        assert identify(TOKEN, forged) is None, forged


def test_island_ones_credential_cannot_act_as_island_zero(guarded):
    server, config = guarded
    attacker = _client(server.address, island_credential(TOKEN, 1))
    honest = _client(server.address, island_credential(TOKEN, 0))
    try:
        with pytest.raises(SynchronizerError) as err:
            attacker.join(0, 1, SPECS)
        assert err.value.reason == "unauthenticated" and "cannot act as island 0" in str(err.value)
        stub = attacker.stubs[0]
        md = attacker.metadata
        for call in (lambda: stub.Heartbeat(pb.HeartbeatRequest(island=0, steps=1), metadata=md, timeout=5),
                     lambda: next(stub.Subscribe(pb.SubscribeRequest(island=0), metadata=md, timeout=5)),
                     lambda: stub.Push(iter([pb.PushChunk(header=pb.PushHeader(island=0, fragment=0))]), metadata=md, timeout=5),
                     lambda: stub.Leave(pb.LeaveRequest(island=0, session=server.service.membership.members[0].session),
                                        metadata=md, timeout=5)):
            with pytest.raises(grpc.RpcError) as rpc_err:
                call()
            assert rpc_err.value.code() == grpc.StatusCode.UNAUTHENTICATED, rpc_err.value.details()
        assert server.service.live_islands() == {0}  # island 0 did not leave, even with its session shown
        attacker.join(1, 1, SPECS)  # as itself it is served
        # with its step time said, its round waits 4 x 10 ms for island 0's entry, not 10 s (rounds.py)
        attacker.heartbeat(1, 1, 0.01)
        assert not _push(attacker, config, 1, seq=1).late
        version = wait_for_version(attacker.pull, 0, 1, timeout=10)[0]
        honest.join(0, 1, SPECS)
        round_index = server.service.status().rounds[0].round
        time.sleep(0.1)  # the honest island steps to that round (a place advances at a bounded rate) and says so
        honest.heartbeat(0, 6, 0.01, schedule_step=round_index * 4 + 2)
        _push(honest, config, 0, seq=1, round=round_index)
        assert wait_for_version(honest.pull, 0, version + 1, timeout=10)[0] > version
        assert attacker.status().islands[0].accepted >= 1  # status: any credential may read it
        assert all_finite({p: f.value for p, f in server.service.run.state.fragments.items()})
    finally:
        attacker.close()
        honest.close()


def test_a_huge_sequence_number_in_one_session_does_not_lock_out_the_islands_next_session():
    """Without a token anyone can be island 0 (the run chose no trust boundary); a session it took
    still cannot refuse the real island 0's pushes once that one rejoins."""
    config = run_config(num_fragments=2, min_quorum=1)
    # a short liveness timeout: the real island 0 gets back in once the attacker's session has been
    # silent that long (while it is heard from, a join as island 0 is refused: island_running)
    server = SynchronizerServer(Synchronizer(config, SynchronizerSettings(liveness_timeout=0.5))).start()
    attacker, honest = _client(server.address, None), SynchronizerClient(server.address, max_retries=2, backoff=0.05)
    try:
        honest.join(0, 1, SPECS)
        for p, value in initial_fragments(config).items():
            honest.seed(0, p, value)
        attacker.join(0, 1, SPECS)  # takes island 0's session
        _push(attacker, config, 0, seq=2**63 - 1)
        version = wait_for_version(attacker.pull, 0, 1, timeout=10)[0]
        attacker.close()
        deadline = time.monotonic() + 30
        while True:  # the real island 0 rejoins, a new session, once the attacker is silent
            try:
                honest.join(0, 1, SPECS)
                break
            except SynchronizerError as err:
                assert err.reason is Reason.ISLAND_RUNNING and time.monotonic() < deadline, err
                time.sleep(0.1)
        for seq in range(1, 6):
            ack = _push(honest, config, 0, seq=seq, round=server.service.status().rounds[0].round)
            assert not ack.duplicate
            version = wait_for_version(honest.pull, 0, version + 1, timeout=10)[0]
        assert server.service.status().refused.get("old_sequence", 0) == 0
    finally:
        attacker.close()
        honest.close()
        server.stop(grace=0)
