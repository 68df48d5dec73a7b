"""Every number of every RPC at its extremes, over the real gRPC server: each is refused with a
reason or bounded, and afterwards join, heartbeat, status, push and a restart from the checkpoint
still work (one push naming round 2**61 made every later call, and every restart, fail)."""

from __future__ import annotations

import math
import time

import grpc
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor as FD

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import Contribution
from lightning_diloco.core.schedule import due_step, fragment_offsets
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport import synchronizer_pb2_grpc as pb_grpc
from lightning_diloco.transport.client import SynchronizerClient
from tests.helpers import SPECS, initial_fragments, layout, run_config, wait_for_version

INT32 = [0, -1, 2**31 - 1, -(2**31)]
INT64 = [0, -1, 2**31, 2**53, 2**62, 2**63 - 1, -(2**63)]
DOUBLE = [0.0, -1.0, 2.0**63, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf]
PROBER = 7  # the island that sends the extremes: joined, with a valid session, as an insider would be


def _extremes(message_type, field: str) -> list:
    kind = message_type.DESCRIPTOR.fields_by_name[field].type
    if kind == FD.TYPE_DOUBLE:
        return DOUBLE
    if kind == FD.TYPE_INT32:
        return INT32
    assert kind == FD.TYPE_INT64, (message_type, field)
    return INT64


def _numeric_fields(message_type) -> list[str]:
    numeric = (FD.TYPE_DOUBLE, FD.TYPE_INT32, FD.TYPE_INT64)
    return [f.name for f in message_type.DESCRIPTOR.fields if f.type in numeric and not f.is_repeated]


class Prober:
    def __init__(self, address: str, config) -> None:
        self.config = config
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.SynchronizerStub(self.channel)
        self.specs = [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, role=s.role) for s in SPECS]
        self.numel = layout(config).fragment_numel(0)
        self.seq = 10
        self.last = ""  # its session: presented at every join, as a client does (else: another process, refused)

    def session(self) -> str:
        return self._join(pb.JoinRequest(island=PROBER, world_size=1, tensors=self.specs))

    def _join(self, request: pb.JoinRequest) -> str:
        request.previous_session = self.last
        session = self.stub.Join(request, timeout=5).session
        if request.island == PROBER:  # (the island field's probes join as others)
            self.last = session
        return session

    def call(self, rpc: str, field: str, value) -> grpc.StatusCode:
        """One call with ``field`` set to ``value`` and every other field valid; the status code."""
        session = self.session()
        self.seq += 1
        try:
            if rpc == "Join" and field == "shape":
                specs = [pb.TensorSpec(name=s.name, shape=[value, *s.shape[1:]], dtype=s.dtype, role=s.role) for s in SPECS]
                self._join(pb.JoinRequest(island=PROBER, world_size=1, tensors=specs))
            elif rpc == "Join":
                self._join(pb.JoinRequest(**{"island": PROBER, "world_size": 1, "tensors": self.specs, field: value}))
            elif rpc == "Heartbeat":
                fields = dict(island=PROBER, steps=10, step_time=0.1, schedule_step=10, session=session)
                self.stub.Heartbeat(pb.HeartbeatRequest(**{**fields, field: value}), timeout=5)
            elif rpc == "Push":
                fields = dict(island=PROBER, fragment=0, round=0, base_version=0, tokens=100.0, steps=4, codec="fp32",
                              seq=self.seq, layout_hash=layout(self.config).hash, payload_bytes=self.numel * 4, session=session)
                header = pb.PushHeader(**{**fields, field: value})
                data = get_codec("fp32").encode(torch.full((self.numel,), 1e-3)).numpy().tobytes()
                self.stub.Push(iter([pb.PushChunk(header=header, data=data)]), timeout=5)
            elif rpc == "Seed":
                fields = dict(island=PROBER, fragment=0, payload_bytes=self.numel * 4, session=session)
                header = pb.FragmentHeader(**{**fields, field: value})
                self.stub.Seed(iter([pb.FragmentChunk(header=header, data=b"\0" * (self.numel * 4))]), timeout=5)
            elif rpc == "Pull":
                fields = dict(fragment=0, island=PROBER, session=session)
                for _ in self.stub.Pull(pb.PullRequest(**{**fields, field: value}), timeout=5):
                    pass
            elif rpc == "ExportFragment":  # the operator's (no token here: every caller is)
                for _ in self.stub.ExportFragment(pb.ExportFragmentRequest(**{field: value}), timeout=5):
                    pass
            elif rpc == "Subscribe":
                request = pb.SubscribeRequest(island=PROBER, session=session)
                if field == "versions":
                    request.versions[int(value[0])] = int(value[1])
                else:
                    setattr(request, field, value)
                call = self.stub.Subscribe(request, timeout=5)
                next(call)  # the first event (the fragments' versions): the subscription is served
                call.cancel()
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED:
                return grpc.StatusCode.OK
            # a refusal names its reason; an unhandled exception (UNKNOWN) or a reply that does
            # not fit its message (the round 2**61 attack) would not
            assert err.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (rpc, field, value, err.details())
            assert Reason.parse(err.details() or "") != Reason.UNKNOWN, (rpc, field, value, err.details())
            return err.code()

    def close(self) -> None:
        self.channel.close()


def _serve(config, directory):
    return SynchronizerServer(Synchronizer(config, SynchronizerSettings(checkpoint_dir=directory, checkpoint_every=1)), max_workers=32).start()


def _step_to(client, island: int, round_index: int) -> None:
    """The island steps to fragment 0's round ``round_index`` before it sends for it, as an honest
    one would (a place advances at a bounded rate, and a send is admitted a round past its
    island's place): heartbeats until the synchronizer has it within a round (at most 30 s)."""
    due = due_step(round_index, fragment_offsets(2, 4)[0], 4)
    deadline = time.monotonic() + 30
    while client.status().islands[island].schedule_step < due - 4 and time.monotonic() < deadline:
        time.sleep(0.1)
        client.heartbeat(island, 1, 0.1, schedule_step=due)


def _honest_round_trip(address, config, island: int) -> None:
    """Join, heartbeat, push (for the round the fragment collects), status and a pull of the
    merged version all work."""
    with SynchronizerClient(address, max_retries=2, backoff=0.05) as client:
        client.join(island, 1, SPECS)
        beat = client.heartbeat(island, 1, 0.1, schedule_step=0)
        assert 0 <= beat.run_step < 2**40
        version, round = beat.versions[0], client.status().rounds[0].round
        _step_to(client, island, round)
        numel = layout(config).fragment_numel(0)
        client.push(Contribution(island=island, fragment=0, round=round, base_version=version, tokens=100.0, steps=4,
                    codec="fp32", seq=1, payload=get_codec("fp32").encode(torch.full((numel,), 1e-3)),
                    layout_hash=layout(config).hash))
        assert wait_for_version(client.pull, 0, version + 1, timeout=10)[0] > version
        status = client.status()
        assert 0 <= status.run_step < 2**40 and all(-1 <= r.round < 2**40 for r in status.rounds.values())


@pytest.mark.timeout(120)
def test_every_number_of_every_rpc_at_its_extremes_leaves_the_run_working(tmp_path):
    config = run_config(num_fragments=2, min_quorum=1)
    server = _serve(config, tmp_path)
    prober = Prober(server.address, config)
    try:
        with SynchronizerClient(server.address, max_retries=1) as founder:
            founder.join(0, 1, SPECS)
            for p, value in initial_fragments(config).items():
                founder.seed(0, p, value)
        probes = [("Join", pb.JoinRequest), ("Heartbeat", pb.HeartbeatRequest), ("Push", pb.PushHeader),
                  ("Seed", pb.FragmentHeader), ("Pull", pb.PullRequest), ("Subscribe", pb.SubscribeRequest),
                  ("ExportFragment", pb.ExportFragmentRequest)]
        outcomes = {}
        for rpc, message_type in probes:
            for field in _numeric_fields(message_type):
                for value in _extremes(message_type, field):
                    outcomes[rpc, field, repr(value)] = prober.call(rpc, field, value)
        for key, value in [(0, 2**63 - 1), (0, -(2**63)), (2**31 - 1, 0), (-(2**31), 5)]:
            outcomes["Subscribe", "versions", repr((key, value))] = prober.call("Subscribe", "versions", (key, value))
        for value in INT64:
            outcomes["Join", "shape", repr(value)] = prober.call("Join", "shape", value)
        assert len(outcomes) > 130  # every numeric field of the seven requests, at every extreme
        assert outcomes["Push", "round", repr(2**63 - 1)] == grpc.StatusCode.OK  # taken, for the latest round the run admits
        state = server.service.snapshot()
        assert all(bool(torch.isfinite(f.value).all()) for f in state.fragments.values())
        _honest_round_trip(server.address, config, island=1)
    finally:
        prober.close()
        server.stop(grace=0)
    restarted = _serve(config, tmp_path)  # from the checkpoint the extremes were written into
    try:
        assert restarted.service.run.state is not None and restarted.service.run.state.outer_steps > 0
        _honest_round_trip(restarted.address, config, island=2)
    finally:
        restarted.stop(grace=0)


@pytest.mark.parametrize("field", ["round", "seq", "base_version", "steps"])
def test_a_huge_number_in_one_push_does_not_reach_any_reply(target, field):
    """The attack that started it: one push with a value of 2**61, then every call of every kind."""
    stub = target.stub()
    numel = layout(target.config).fragment_numel(0)
    fields = dict(island=0, fragment=0, round=0, base_version=0, tokens=100.0, steps=4, codec="fp32", seq=1,
                  layout_hash=layout(target.config).hash, payload_bytes=numel * 4, session=target.honest.sessions[0])
    header = pb.PushHeader(**{**fields, field: 2**61})
    try:
        stub.Push(iter([pb.PushChunk(header=header, data=b"\0" * (numel * 4))]), timeout=5)
    except grpc.RpcError as err:
        assert Reason.parse(err.details()) != Reason.UNKNOWN
    target.service.poll()
    assert target.honest.heartbeat(0, 1, 0.1, schedule_step=2).run_step < 2**40
    assert target.honest.status().run_step < 2**40
    target.honest.join(0, 1, SPECS)
    round_now = max(0, target.service.status().rounds[0].round)
    _step_to(target.honest, 0, round_now)
    ack = target.push(target.honest, 0, 0, torch.full((numel,), 1e-3), round=round_now, base_version=0, seq=2)
    assert not ack.late


# each field of a push or seed header at the values refused, and how its refusal names it
REFUSED_HEADER_VALUES = {
    ("Push", "round"): ([-1, -(2**63)], "round={}"),
    ("Push", "base_version"): ([-1, -(2**63)], "base_version={}"),
    ("Push", "seq"): ([-1, -(2**63)], "seq={}"),
    ("Push", "tokens"): ([0.0, -1.0, 5e-324, 1e308, math.nan, math.inf, -math.inf], "tokens={}"),
    ("Push", "steps"): ([0, -1, 2**63 - 1, -(2**63)], "steps={}"),
    ("Push", "payload_bytes"): ([0, -1, 2**63 - 1, -(2**63)], "declares {} bytes"),
    ("Push", "fragment"): ([-1, 2**31 - 1, -(2**31)], "fragment {}"),
    ("Push", "island"): ([-1, 2**31 - 1, -(2**31)], "island {}"),
    ("Seed", "payload_bytes"): ([0, -1, 2**63 - 1, -(2**63)], "declares {} bytes"),
    ("Seed", "fragment"): ([-1, 2**31 - 1, -(2**31)], "fragment {}"),
    ("Seed", "island"): ([-1, 2**31 - 1, -(2**31)], "island {}"),
}


@pytest.mark.timeout(120)
def test_a_refused_header_value_is_named_in_the_refusal_and_changes_nothing(tmp_path):
    """Over the real server: every push and seed header field at its refused extremes gets a
    refusal that names the field with the value sent, and leaves the fragments, their versions and
    rounds, and the accepted counts as they were. (A negative round was refused as 'sequence number
    12, round -1 and base version 0 must be >= 0', which does not say which one; fragment -1 as
    'not owned by shard 0 ... shard 0 owns it'.)"""
    config = run_config(num_fragments=2, min_quorum=2)
    server = _serve(config, tmp_path)
    prober = Prober(server.address, config)
    service, stub, details = server.service, prober.stub, []

    def observed():
        status = service.status()
        return ({p: f.value.clone() for p, f in service.run.state.fragments.items()}, service.versions(),
                {p: (r.round, r.open_contributors, r.closed) for p, r in status.rounds.items()}, dict(status.accepted))

    try:
        with SynchronizerClient(server.address, max_retries=1) as founder:
            founder.join(0, 1, SPECS)
            for p, value in initial_fragments(config).items():
                founder.seed(0, p, value)
        before = observed()

        class Recording:  # the prober's stub, keeping each refusal's details
            def __getattr__(self, name):
                def call(*args, **kwargs):
                    try:
                        return getattr(stub, name)(*args, **kwargs)
                    except grpc.RpcError as err:
                        details.append(err.details() or "")
                        raise
                return call

        prober.stub = Recording()
        for (rpc, field), (values, naming) in REFUSED_HEADER_VALUES.items():
            for value in values:
                details.clear()
                code = prober.call(rpc, field, value)
                assert code != grpc.StatusCode.OK and details, (rpc, field, value)
                assert naming.format(value) in details[-1], (rpc, field, value, details[-1])
                assert "owns it" not in details[-1] or field != "fragment", details[-1]  # no shard owns it
                after = observed()
                assert all(torch.equal(after[0][p], before[0][p]) for p in before[0]) and after[1:] == before[1:], \
                    (rpc, field, value)
    finally:
        prober.stub = stub
        prober.close()
        server.stop(grace=0)


@pytest.mark.timeout(120)
def test_a_hostile_sparse_payload_is_refused_with_its_reason_and_an_honest_one_is_merged(tmp_path):
    """Over the real server, a run on the sparse codec (density 1/4: k = 17 of fragment 0's 68
    values): a payload whose indices repeat, run past the fragment, or come from a denser setting
    is refused as bad_payload naming what was wrong, and changes nothing; an honest one is merged."""
    import dataclasses

    from lightning_diloco.core.config import CodecConfig
    from lightning_diloco.core.sparse_codec import SparseCodec
    from lightning_diloco.reasons import SynchronizerError
    from tests.helpers import sparse_payload_with_indices

    config = dataclasses.replace(run_config(num_fragments=2, min_quorum=1),
                                 codec=CodecConfig(uplink="sparse", downlink="sparse", sparse_density=0.25))
    server = _serve(config, tmp_path)
    numel = layout(config).fragment_numel(0)
    codec = SparseCodec(0.25)
    k = round(0.25 * numel)
    honest = codec.encode(torch.linspace(-1e-3, 1e-3, numel))

    def with_indices(index):
        return sparse_payload_with_indices(honest, codec, numel, index)

    hostile = {
        "duplicate": (with_indices([0, 0] + list(range(2, k))), "not strictly ascending"),
        "out of range": (with_indices(list(range(k - 1)) + [numel]), f"index {numel} past its last chunk of {numel} values"),
        "denser": (SparseCodec(0.5).encode(torch.linspace(-1e-3, 1e-3, numel)), "but its codec and fragment need"),
    }
    try:
        with SynchronizerClient(server.address, max_retries=0) as client:
            client.join(0, 1, SPECS)
            for p, value in initial_fragments(config).items():
                client.seed(0, p, value)
            before = server.service.run.state.fragments[0].value.clone(), server.service.versions()
            client.heartbeat(0, 1, 0.1, schedule_step=0)
            collecting = max(0, client.status().rounds[0].round)
            _step_to(client, 0, collecting)
            for seq, (what, (payload, naming)) in enumerate(hostile.items(), start=1):
                with pytest.raises(SynchronizerError) as err:
                    client.push(Contribution(island=0, fragment=0, round=collecting, base_version=before[1][0], tokens=100.0,
                                             steps=4, codec="sparse", seq=seq, payload=payload, layout_hash=layout(config).hash))
                assert err.value.reason == "bad_payload" and naming in str(err.value), (what, str(err.value))
                assert torch.equal(server.service.run.state.fragments[0].value, before[0]) and server.service.versions() == before[1]
            client.push(Contribution(island=0, fragment=0, round=collecting, base_version=before[1][0], tokens=100.0, steps=4,
                                     codec="sparse", seq=10, payload=honest, layout_hash=layout(config).hash))
            assert wait_for_version(client.pull, 0, before[1][0] + 1, timeout=10)[0] > before[1][0]
            assert server.service.status().refused.get("bad_payload", 0) == len(hostile)
    finally:
        server.stop(grace=0)
