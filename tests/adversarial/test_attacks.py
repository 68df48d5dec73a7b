"""Every attack of the first adversarial review against a real server: refused with its reason (or bounded), the global
state finite and, when refused, bit-identical, and Status still answered within a second."""

from __future__ import annotations

import gc
import resource
import threading
import time

import grpc
import pytest
import torch

from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport.client import SynchronizerClient, SynchronizerError
from tests.adversarial.conftest import all_finite, header
from tests.helpers import SPECS, layout


def _attacker(target, island=1):
    client = SynchronizerClient(target.server.address, max_retries=1, backoff=0.05)
    client.join(island, 1, SPECS)
    return client


def test_a_finite_but_huge_delta_is_bounded_and_the_model_stays_finite(target):
    attacker = _attacker(target)
    try:
        before = target.snapshot()
        target.push(attacker, 1, 0, torch.full((layout(target.config).fragment_numel(0),), 1e20))
        target.settle(0, 1)
        after = target.snapshot()
        assert all_finite(after)
        moved = float((after[0] - before[0]).abs().max())
        assert moved < 10 * float(before[0].norm())  # bounded by the fragment's own size on a first round
        target.push(target.honest, 0, 0, torch.full_like(before[0], 0.001), round=1, base_version=1, seq=1)
        target.settle(0, 2)  # the fragment still takes pushes and pulls
        assert all_finite(target.snapshot())
        target.answers_status_promptly()
    finally:
        attacker.close()


@pytest.mark.parametrize("tokens", [1e9, 1e15])
def test_absurd_token_counts_cannot_drown_an_honest_island(target, tokens):
    attacker = _attacker(target)
    numel = layout(target.config).fragment_numel(0)
    try:
        honest_delta = torch.full((numel,), 0.01)
        target.push(target.honest, 0, 0, honest_delta, seq=1)  # closes round 0 alone: the honest vote
        target.settle(0, 1)
        base = target.snapshot()[0]
        ack = target.push(attacker, 1, 0, -honest_delta, round=1, base_version=1, seq=1, tokens=tokens, steps=1)
        target.push(target.honest, 0, 0, honest_delta, round=1, base_version=1, seq=2)
        target.settle(0, 2)
        step = target.snapshot()[0] - base
        assert all_finite({0: step}) and not ack.late
        # the attacker counts at most 4 x the run's tokens per step: the honest island is not a rounding error
        assert target.service.status().rounds[0].merged_entries >= 2
        assert float(step.norm()) < 10 * 2 * float(honest_delta.norm())
    finally:
        attacker.close()


@pytest.mark.parametrize("tokens", [5e-324, 1e-200])
def test_a_token_count_whose_weight_underflows_is_refused_and_the_round_still_closes(target, tokens):
    """tokens**2 underflowed to a weight of 0.0: the round holding that entry (alone, or beside an
    honest one, whose weight was capped to the lower median, 0) failed its close on every look and
    the fragment never stepped again."""
    attacker = _attacker(target)
    numel = layout(target.config).fragment_numel(0)
    try:
        before = target.snapshot()
        with pytest.raises(SynchronizerError, match="tokens=") as refused:
            target.push(attacker, 1, 0, torch.full((numel,), 0.01), seq=1, tokens=tokens)
        assert refused.value.reason == "bad_counters"
        assert target.snapshot()[0].equal(before[0]) and target.service.versions()[0] == 0
        target.push(target.honest, 0, 0, torch.full((numel,), 0.01), seq=1)
        target.settle(0, 1)  # the honest island's round closes
        assert target.service.status().rounds[0].merged_entries == 1
    finally:
        attacker.close()


def test_a_delta_of_subnormal_values_does_not_stop_its_fragment(target):
    """A push of a few subnormal values made the merge's float32 factor w / |delta| overflow: the
    round's close raised on every look and the fragment never stepped again."""
    attacker = _attacker(target)
    numel = layout(target.config).fragment_numel(0)
    try:
        target.push(attacker, 1, 0, torch.full((numel,), 1e-45), seq=1, codec="fp32")
        target.push(target.honest, 0, 0, torch.full((numel,), 0.01), seq=1)
        target.settle(0, 1)
        target.push(target.honest, 0, 0, torch.full((numel,), 0.01), round=1, base_version=1, seq=2)
        target.settle(0, 2)  # and the next round closes too
        assert all_finite(target.snapshot())
    finally:
        attacker.close()


def test_a_pull_cannot_pin_the_servers_workers(target):
    """Pull answers with the current version at once (new versions reach islands through their
    subscriptions); a pull can hold its worker while its reply is unread, so it is a long call:
    a flood of pulls from more islands than the server has workers (each island may have 2 open)
    is answered or refused busy, and Status and the honest island's pull are still answered."""
    stub = target.stub()
    specs = [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, role=s.role) for s in SPECS]
    sessions = {i: stub.Join(pb.JoinRequest(island=i, world_size=1, tensors=specs), timeout=10).session for i in range(1, 21)}
    calls = [stub.Pull(pb.PullRequest(fragment=0, island=i, session=session), timeout=30)  # 40: all started, none read yet
             for i, session in sessions.items() for _ in range(2)]
    target.answers_status_promptly()
    for c in calls:
        try:
            assert next(c).header.version == 0
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert target.honest.pull(0)[0] == 0


def test_an_infinite_step_time_does_not_stall_the_rounds(target):
    target.honest.heartbeat(0, 10, float("inf"), schedule_step=10)
    attacker = _attacker(target)
    try:
        attacker.heartbeat(1, 10, float("inf"))
        # the run is at step 10: round 2 of fragment 0 (H = 4, offset 2)
        target.push(target.honest, 0, 0, torch.zeros(layout(target.config).fragment_numel(0)), round=2, seq=1)
        target.settle(0, 1)  # closed: a step time of inf is ignored, so the grace window stays bounded
        assert target.service.status().islands[1].step_time_s < 3600
    finally:
        attacker.close()


def test_another_islands_id_is_refused_without_its_session(target):
    stub = target.stub()
    numel = layout(target.config).fragment_numel(0)
    before = target.snapshot()
    for session in ("", "guessed"):
        chunk = pb.PushChunk(header=header(target.config, seq=2**63 - 1, session=session), data=b"\0" * (numel * 4))
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(iter([chunk]), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and err.value.details().startswith("wrong_session")
    with pytest.raises(grpc.RpcError) as err:
        stub.Heartbeat(pb.HeartbeatRequest(island=0, steps=1, session="guessed"), timeout=5)
    assert err.value.details().startswith("wrong_session")
    # the real island 0 is not locked out by the forged sequence number
    target.push(target.honest, 0, 0, torch.zeros(numel), seq=1)
    target.settle(0, 1)
    assert all(torch.equal(before[1], target.snapshot()[1]) for _ in [0])
    target.answers_status_promptly()


def test_header_only_streams_allocate_nothing(target):
    """Pushes that declare a whole fragment and send no data: memory grows with data, not headers."""
    stub = target.stub()
    numel = layout(target.config).fragment_numel(0)
    gc.collect()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hung = threading.Event()

    def header_then_wait():
        yield pb.PushChunk(header=header(target.config, session=target.honest.sessions[0], seq=7))
        hung.wait(9)

    calls = [stub.Push.future(header_then_wait(), timeout=10) for _ in range(16)]
    deadline = time.monotonic() + 8
    while sum(c.done() for c in calls) < 16 - 4 and time.monotonic() < deadline:  # the server saw them all
        time.sleep(0.05)
    target.answers_status_promptly()
    hung.set()
    refusals = []
    for c in calls:
        with pytest.raises(grpc.RpcError) as err:
            c.result()
        refusals.append(err.value.details().split(":")[0])
    # one island holds at most P + 2 push streams: the rest are refused at once
    assert set(refusals) <= {"bad_payload", "busy"} and refusals.count("bad_payload") <= 2 + 2
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kb < 16 * numel * 4 / 1024 + 20_000


@pytest.mark.parametrize("shape", [(-1, 4), (0, 4), (10**12, 10**3)])
def test_a_first_joiner_with_an_impossible_layout_is_refused_and_nothing_is_adopted(shape):
    from lightning_diloco.synchronizer.server import SynchronizerServer
    from lightning_diloco.synchronizer.service import Synchronizer
    from tests.helpers import run_config

    server = SynchronizerServer(Synchronizer(run_config(num_fragments=1))).start()
    client = SynchronizerClient(server.address, max_retries=0)
    try:
        request = pb.JoinRequest(island=0, world_size=1, tensors=[pb.TensorSpec(name="w", shape=list(shape), dtype="float32", role="dense")])
        with pytest.raises(grpc.RpcError) as err:
            client.stubs[0].Join(request, timeout=5)
        assert err.value.details().startswith("layout_mismatch")
        assert server.service.run.state is None and server.service.status().layout_hash == ""
        assert client.join(0, 1, SPECS).layout_hash  # an honest island can still start the run
    finally:
        client.close()
        server.stop(grace=0)


def test_empty_streams_unknown_roles_and_long_inputs_get_clear_bounded_refusals(target):
    stub = target.stub()
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter([]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("bad_payload")
    with pytest.raises(grpc.RpcError) as err:
        stub.Seed(iter([]), timeout=5)
    assert err.value.details().startswith("bad_payload")
    bad_role = pb.JoinRequest(island=3, world_size=1, tensors=[pb.TensorSpec(name="w", shape=[4], dtype="float32", role="x" * 100000)])
    with pytest.raises(grpc.RpcError) as err:
        stub.Join(bad_role, timeout=5)
    assert err.value.details().startswith("layout_mismatch") and len(err.value.details()) <= 1000
    chunk = pb.PushChunk(header=header(target.config, codec="c" * 1_000_000, session=target.honest.sessions[0]))
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter([chunk]), timeout=5)
    assert err.value.details().startswith("unknown_codec") and len(err.value.details()) <= 1000


def test_a_reused_sequence_number_with_another_payload_is_refused(target):
    numel = layout(target.config).fragment_numel(0)
    target.push(target.honest, 0, 0, torch.full((numel,), 0.01), seq=5)
    with pytest.raises(SynchronizerError) as err:
        target.push(target.honest, 0, 0, torch.full((numel,), 0.02), seq=5)
    assert err.value.reason == "sequence_reused"
    assert target.push(target.honest, 0, 0, torch.full((numel,), 0.01), seq=5).duplicate  # a true retry is fine


def test_phantom_islands_are_bounded_and_forgotten(target, monkeypatch):
    from lightning_diloco.synchronizer import membership

    monkeypatch.setattr(membership, "MAX_ISLANDS", 50)
    stub = target.stub()
    request = [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, role=s.role) for s in SPECS]
    for i in range(1, 50):
        stub.Join(pb.JoinRequest(island=1000 + i, world_size=1, tensors=request), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        stub.Join(pb.JoinRequest(island=99999, world_size=1, tensors=request), timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.details().startswith("too_many_islands")
    target.answers_status_promptly()
    clock = target.service.clock
    monkeypatch.setattr(target.service, "clock", lambda: clock() + 10_000)
    target.honest.heartbeat(0, 1, 0.1)  # rejoins: its own session was forgotten too
    stub.Join(pb.JoinRequest(island=5, world_size=1, tensors=request), timeout=5)  # pruning happens at join
    assert len(target.service.status().islands) <= 3
