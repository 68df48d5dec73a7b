"""Resources are bounded before anything is trusted: a push's header is checked before
its payload is read, one island's streams take only that island's slots, and the version history
does not grow with the islands that ever joined."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from lightning_diloco.synchronizer import deadlines
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport.client import SynchronizerClient
from tests.adversarial.conftest import header
from tests.helpers import SPECS, layout


def test_slow_push_streams_from_no_session_hold_no_worker(target):
    """More trickling pushes than the server has workers: each is refused on its header."""
    stub = target.stub()
    hung = threading.Event()

    def header_then_trickle():
        yield pb.PushChunk(header=header(target.config, island=0, session=""), data=b"\0")
        hung.wait(10)  # a byte every few seconds, as the slow-stream attack sent
        yield pb.PushChunk(data=b"\0")

    calls = [stub.Push.future(header_then_trickle(), timeout=20) for _ in range(40)]  # the server has 24 workers
    try:
        for c in calls:  # refused on the header, while the client still holds its stream open
            assert c.exception(timeout=10).details().startswith("wrong_session")
        numel = layout(target.config).fragment_numel(0)
        target.answers_status_promptly()
        target.honest.heartbeat(0, 1, 0.1)
        target.push(target.honest, 0, 0, torch.full((numel,), 1e-3), seq=1)
        target.settle(0, 1)
        newcomer = SynchronizerClient(target.server.address, max_retries=0)
        assert newcomer.join(5, 1, SPECS).layout_hash
        newcomer.close()
    finally:
        hung.set()


def test_one_islands_subscriptions_cannot_take_the_slots_of_the_others(target):
    attacker = SynchronizerClient(target.server.address, max_retries=0)
    attacker.join(1, 1, SPECS)
    stub = attacker.stubs[0]
    request = pb.SubscribeRequest(island=1, session=attacker.sessions[0])
    calls = [stub.Subscribe(request, timeout=20) for _ in range(40)]  # never read; the long-call slots are 16
    try:
        deadline = time.monotonic() + 10
        while not any(c.done() for c in calls) and time.monotonic() < deadline:
            time.sleep(0.05)
        # two slots of its own: the rest are refused busy, or end when a newer one replaces them
        assert any(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls if c.done())
        assert target.server.servicer.slots.held[(1, "subscription")] <= 2
        events = target.honest.stubs[0].Subscribe(pb.SubscribeRequest(island=0, session=target.honest.sessions[0]), timeout=5)
        assert next(events).chunk.header.version == 0  # the honest island is served its fragments
        events.cancel()
        target.answers_status_promptly()
    finally:
        for c in calls:
            c.cancel()
        attacker.close()


def test_other_islands_unread_subscriptions_cannot_get_an_honest_pull_refused_busy(target):
    """No token: anyone may join as any number of islands, each with its 2 subscription slots.
    Unread subscriptions of enough made-up islands used to take every long-call worker (260 at
    the default 256 workers), and the honest island's pull was refused busy."""
    stub = target.stub()
    specs = [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, role=s.role) for s in SPECS]
    calls = []
    try:
        for i in range(1, 21):  # 20 subscriptions: more than the 16 long-call workers of this server
            session = stub.Join(pb.JoinRequest(island=i, world_size=1, tensors=specs, previous_session=""), timeout=5).session
            calls.append(stub.Subscribe(pb.SubscribeRequest(island=i, session=session), timeout=60))
        for c in calls:  # each has been answered (served, or refused busy) before the honest pull
            try:
                next(c)
            except grpc.RpcError:
                pass
        assert any(c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls)  # the subscriptions' share is full
        for fragment in (0, 1):  # the honest island pulls, twice over, and is served each time
            for _ in range(2):
                assert target.honest.pull(fragment)[0] == 0
        target.answers_status_promptly()
    finally:
        for c in calls:
            c.cancel()


def test_version_history_is_bounded_by_the_setting_not_by_islands_that_joined(target):
    stub = target.stub()
    specs = [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, role=s.role) for s in SPECS]
    for i in range(200):  # made-up islands (no token on this run: anyone may join)
        stub.Join(pb.JoinRequest(island=1000 + i, world_size=1, tensors=specs), timeout=5)
    numel = layout(target.config).fragment_numel(0)
    for r in range(12):
        time.sleep(0.01)  # the island's pace: 200 islands at step 0 hold the run's clock, so its own place,
        # which advances at most 1000 steps a second (membership.py), is what admits its round (4 steps each)
        target.push(target.honest, 0, 0, torch.full((numel,), 1e-3), round=r, base_version=r, seq=r + 1)
        target.settle(0, r + 1)
    assert len(target.service.run.state.fragments[0].history) <= target.config.merge.history
    assert len(target.service.snapshot().fragments[0].history) <= target.config.merge.history  # and in checkpoints


def test_slow_pushes_with_a_valid_session_are_cut_off_and_free_their_slots(target, monkeypatch):
    """Issue 21: a push with the island's own session, sending its payload a byte at a time, held
    its stream slot (and a worker) for as long as the client liked; P + 2 of them locked the
    island out. Each payload now has a read deadline after which the stream is cancelled."""
    monkeypatch.setattr(deadlines, "PAYLOAD_GRACE_S", 1.0)
    stub = target.stub()
    hung = threading.Event()
    session = target.honest.sessions[0]

    def header_then_trickle():
        yield pb.PushChunk(header=header(target.config, island=0, session=session, seq=99), data=b"\0")
        hung.wait(60)
        yield pb.PushChunk(data=b"\0")

    slots = target.config.schedule.num_fragments + 2
    calls = [stub.Push.future(header_then_trickle(), timeout=60) for _ in range(slots)]
    try:
        for c in calls:  # each is cut off by the server, long before the client would end it
            assert c.exception(timeout=30).code() == grpc.StatusCode.CANCELLED
        assert target.server.servicer.deadlines.cancelled == slots
        deadline = time.monotonic() + 10  # the handlers release their slots just after the client hears it
        while target.server.servicer.slots.held[(0, "payload")] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert target.server.servicer.slots.held[(0, "payload")] == 0
        numel = layout(target.config).fragment_numel(0)
        target.push(target.honest, 0, 0, torch.full((numel,), 1e-3), seq=1)  # the island pushes again
        target.settle(0, 1)
        assert target.service.status().refused.get("bad_payload", 0) >= slots
    finally:
        hung.set()


def test_a_join_with_another_tensor_count_is_refused_before_its_tensors_are_read(target, monkeypatch):
    """Every join's tensors were read (each checked as a TensorSpec) before anything else: 250,000
    of them took 2.2 s of the synchronizer's interpreter, and four clients joining so in a loop
    slowed the honest island's rounds 180x (10 rounds: 0.08 s, 14.75 s; 3.4 s now, what receiving
    the bytes costs). Once the run's model is adopted a join must have its tensor count, checked
    first; the refusal names both counts."""
    from lightning_diloco.synchronizer import server

    read = []

    class CountedSpec(server.TensorSpec):
        def __post_init__(self):
            read.append(self.name)
            super().__post_init__()

    monkeypatch.setattr(server, "TensorSpec", CountedSpec)
    huge = [pb.TensorSpec(name=f"t{i}", shape=[1], dtype="float32", role="dense") for i in range(20_000)]
    with pytest.raises(grpc.RpcError) as err:
        target.stub().Join(pb.JoinRequest(island=1, world_size=1, tensors=huge), timeout=30)
    assert err.value.details().startswith("layout_mismatch") and "20000 trainable tensors, the run's has 4" in err.value.details()
    assert read == []  # none of them was read
    target.honest.join(0, 1, SPECS)  # the run's model still joins
    assert len(read) == len(SPECS)
