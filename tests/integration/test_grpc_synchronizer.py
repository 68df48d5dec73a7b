"""The synchronizer over real gRPC on port 0, learners as threads."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import logging
import socket
import threading
import time

import grpc
import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.fragments import split_fragment
from lightning_diloco.core.guard import agreeing, capped_weights
from lightning_diloco.core.merge import contribution_weight, merge_outer_gradients
from lightning_diloco.core.outer import OuterOptimizer
from lightning_diloco.core.protocol import Contribution
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.fragment import Fragment
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport import synchronizer_pb2_grpc as pb_grpc
from lightning_diloco.transport.client import SynchronizerClient, SynchronizerError
from tests.helpers import SPECS, initial_fragments, layout, run_config, wait_for_version


def _push(client, config, island, fragment, delta, *, round=0, base_version=0, seq=0, codec="fp32", tokens=100.0, steps=4):
    return client.push(Contribution(
        island=island, fragment=fragment, round=round, base_version=base_version, tokens=tokens, steps=steps, codec=codec,
        seq=seq, payload=get_codec(codec).encode(delta), layout_hash=layout(config).hash,
    ))


def _seeded(client, config, island=0):
    info = client.join(island, 1, SPECS)
    for p, value in initial_fragments(config).items():
        client.seed(island, p, value)
    return info


class Events:
    """Collects one island's subscription events; tests wait on them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.requests: list[tuple[int, int, int]] = []
        self.versions: list = []
        self.held: dict[int, int] = {}
        self.reconnects = 0

    def on_request(self, request):
        with self.cond:
            self.requests.append((request.fragment, request.round, request.due_step))
            self.cond.notify_all()

    def on_version(self, event):
        with self.cond:
            self.versions.append(event)
            self.held[event.fragment] = event.version
            self.cond.notify_all()

    def on_reconnect(self):
        with self.cond:
            self.reconnects += 1

    def subscribe(self, client, island, held):
        self.held = dict(held)
        return client.subscribe(island, lambda: dict(self.held), on_request=self.on_request, on_version=self.on_version,
                                on_reconnect=self.on_reconnect)

    def version(self, fragment, version, timeout=10.0):
        return self.first(lambda e: e.fragment == fragment and e.version >= version, f"version {version} of fragment {fragment}", timeout)

    def first(self, matches, what, timeout=10.0, after=0):
        """The first version event from index ``after`` on that matches, waiting for it: events of
        different fragments arrive in any order."""
        def find():
            return next((e for e in self.versions[after:] if matches(e)), None)

        with self.cond:
            assert self.cond.wait_for(find, timeout), f"no {what}: {self.versions}"
            return find()


def _timeless(status):
    """A status without the fields that move with the clock between two reads."""
    islands = {i: dataclasses.replace(s, seen_s_ago=0.0, merged_s_ago=None) for i, s in status.islands.items()}
    return dataclasses.replace(status, islands=islands, run_step=0)


@pytest.fixture
def started():
    servers, clients = [], []

    def start(config, *, token=None, client_token=None, **service_kwargs):
        server = SynchronizerServer(Synchronizer(config, SynchronizerSettings(**service_kwargs)), token=token).start()
        client = SynchronizerClient(server.address, token=client_token if client_token is not None else token, max_retries=2, backoff=0.05)
        servers.append(server)
        clients.append(client)
        return server, client

    yield start
    for c in clients:
        c.close()
    for s in servers:
        s.stop(grace=0)


def test_join_seed_push_and_every_version_reaches_the_subscription(started):
    config = run_config(uplink="int8", downlink="bf16")
    server, client = started(config)
    info = _seeded(client, config)
    assert info.config == config and info.layout_hash == layout(config).hash and info.run_step == 0
    version, value = client.pull(1)
    assert version == 0 and torch.equal(value, initial_fragments(config)[1])
    events = Events()
    events.subscribe(client, 0, {0: 0, 1: 0})
    ack = _push(client, config, 0, 1, torch.full_like(value, 0.01), codec="int8")
    assert (ack.fragment, ack.round, ack.late, ack.duplicate, ack.version) == (1, 0, False, False, 0)
    event = events.version(1, 1)
    assert (event.base_version, event.codec, event.round, event.included) == (0, "bf16", 0, True)
    update = get_codec("bf16").decode(event.payload, value.numel())
    _, global_value = client.pull(1)
    assert torch.allclose(value + update, global_value, atol=1e-3)
    assert client.bytes_sent > get_codec("int8").encoded_size(value.numel()) and client.bytes_received > 0
    # the status read over gRPC is the service's own, typed, islands and fragments keyed by int
    over_grpc, in_process = client.status(), server.service.status()
    assert over_grpc.islands[0].accepted == 1 and over_grpc.rounds[1].last.contributors == 1
    assert _timeless(over_grpc) == _timeless(in_process)


def test_an_island_behind_on_an_int4_downlink_gets_the_steps_since_and_holds_what_a_pull_gives(started):
    """Each version goes down once as an int4 step from the value the islands hold
    (core/downlink.py): a subscription that holds an older version gets the steps in between, in
    order, and adding them lands exactly on the value a pull gives (the published value, within one
    quantisation step of the global one; never the global one itself, or the next step would miss)."""
    config = run_config(downlink="int4")
    server, client = started(config)
    _seeded(client, config)
    _, held = client.pull(1)
    numel = held.numel()
    g = torch.Generator().manual_seed(3)
    for v in range(3):
        _push(client, config, 0, 1, 0.05 * torch.randn(numel, generator=g), round=v, base_version=v, seq=v)
        wait_for_version(client.pull, 1, v + 1)
    events = Events()
    events.subscribe(client, 0, {0: 0, 1: 0})
    events.version(1, 3)
    chain = [e for e in events.versions if e.fragment == 1]
    assert [(e.version, e.base_version, e.codec, e.round) for e in chain] == [(1, 0, "int4", 0), (2, 1, "int4", 1), (3, 2, "int4", 2)]
    assert [e.included for e in chain] == [False, False, True]  # island 0's last merge is in version 3
    for e in chain:
        held = held + get_codec("int4").decode(e.payload, numel)
    version, pulled = client.pull(1)
    frag = server.service.run.state.fragments[1]
    assert version == 3 and torch.equal(held, pulled) and torch.equal(pulled, frag.published_value())
    assert 0 < float((pulled - frag.value).abs().max()) < 0.05  # outer steps here move values by ~0.2
    assert client.bytes_received > 0 and server.service.tally.bytes_out == 3 * get_codec("int4").encoded_size(numel)


def test_a_large_fragment_is_streamed_in_chunks(started):
    """A fragment far above gRPC's 4 MB message limit goes through in 1 MB chunks, both ways."""
    from lightning_diloco.core.fragments import TensorSpec

    specs = [TensorSpec(name="big", shape=(1_500_000 * 2,), dtype="float32", role="dense")]
    config = run_config(num_fragments=1, downlink="fp32")
    server, client = started(config)
    client.join(0, 1, specs)
    value = torch.randn(3_000_000)
    client.seed(0, 0, value)  # 12 MB
    events = Events()
    events.subscribe(client, 0, {0: -1})  # holds nothing: gets the full value
    assert torch.equal(get_codec("fp32").decode(events.version(0, 0).payload, 3_000_000), value)
    client.push(Contribution(island=0, fragment=0, round=0, base_version=0, tokens=1.0, steps=1, codec="fp32", seq=0,
                payload=get_codec("fp32").encode(torch.zeros(3_000_000)), layout_hash=server.service.run.state.layout.hash))
    assert len(events.version(0, 1).payload) == 12_000_000
    assert torch.equal(client.pull(0)[1], value)  # zero delta, zero momentum: unchanged


def test_refusals_carry_their_reason_over_grpc_and_change_nothing(started):
    config = run_config()
    server, client = started(config)
    _seeded(client, config)
    numel = layout(config).fragment_numel(0)
    with pytest.raises(SynchronizerError) as err:
        _push(client, config, 0, 0, torch.zeros(numel), tokens=-1.0)
    assert err.value.reason == "bad_counters" and err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "out of range" in str(err.value)  # says what was wrong
    with pytest.raises(SynchronizerError) as err:
        _push(client, config, 0, 9, torch.zeros(numel))
    assert err.value.reason == "unknown_fragment" and err.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert server.service.status().refused == {"bad_counters": 1, "unknown_fragment": 1}
    assert server.service.versions() == {0: 0, 1: 0}


def test_oversized_or_short_payload_is_refused_before_it_is_merged(started):
    config = run_config()
    server, client = started(config)
    _seeded(client, config)
    numel = layout(config).fragment_numel(0)
    stub = client.stubs[0]
    header = pb.PushHeader(island=0, fragment=0, base_version=0, tokens=1, steps=1, codec="fp32", seq=0,
                           layout_hash=layout(config).hash, payload_bytes=numel * 4, session=client.sessions[0])
    too_much = [pb.PushChunk(header=header, data=b"\0" * (numel * 4)), pb.PushChunk(data=b"\0" * 1000)]
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter(too_much), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("bad_payload")
    lying = pb.PushHeader(island=0, fragment=0, base_version=0, tokens=1, steps=1, codec="fp32", seq=0,
                          layout_hash=layout(config).hash, payload_bytes=10**12, session=client.sessions[0])
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter([pb.PushChunk(header=lying)]), timeout=5)
    assert err.value.details().startswith("bad_payload")
    assert server.service.versions() == {0: 0, 1: 0}


class _Calls:
    """A service as the server sees it, recording each call made into it (by name)."""

    def __init__(self, service) -> None:
        self.service, self.names = service, []

    def __getattr__(self, name):
        value = getattr(self.service, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            self.names.append(name)
            return value(*args, **kwargs)

        return call


def test_a_push_over_grpc_is_one_call_into_the_service_and_one_admission(started, monkeypatch):
    """The header is admitted once, then the payload is read and handed over with the admission's
    result (push_admission.py, fragment.py); Push used to call the service 3 times, and admit its header twice."""
    config = run_config()
    server, client = started(config)
    _seeded(client, config)
    admitted = []
    admit = Fragment.admit
    monkeypatch.setattr(Fragment, "admit", lambda *args: admitted.append(args) or admit(*args))
    calls = _Calls(server.service)
    monkeypatch.setattr(server.servicer, "service", calls)
    ack = _push(client, config, 0, 0, torch.full((layout(config).fragment_numel(0),), 0.01))
    assert not ack.duplicate and calls.names == ["push"] and len(admitted) == 1
    with pytest.raises(SynchronizerError) as err:  # refused from the header: still one call, no payload read
        _push(client, config, 0, 0, torch.zeros(3), seq=1)
    assert err.value.reason == "bad_payload" and "declares 12 bytes" in str(err.value)
    assert calls.names == ["push", "push"] and len(admitted) == 2


@pytest.mark.parametrize("client_token", ["", "wrong"])
def test_missing_or_wrong_token_is_refused(started, client_token):
    config = run_config()
    server, client = started(config, token="s3cret", client_token=client_token)
    with pytest.raises(SynchronizerError) as err:
        client.join(0, 1, SPECS)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert server.service.status().refused == {"unauthenticated": 1}


def test_a_client_refused_in_a_loop_does_not_fill_the_log(started, caplog):
    """Every refusal was a log line: one client without the token calling Status in a loop wrote
    3,700 lines (620 kB) a second. Now a reason's refusals after its first are said at most once
    per 10 s, with how many were left out; Status still counts each one."""
    server, _ = started(run_config(), token="s3cret")
    stub = pb_grpc.SynchronizerStub(channel := grpc.insecure_channel(server.address))
    started_at = time.monotonic()
    try:
        for _ in range(300):
            with pytest.raises(grpc.RpcError):
                stub.Status(pb.StatusRequest(), timeout=5)
    finally:
        channel.close()
    windows = (time.monotonic() - started_at) // 10 + 1  # one line per 10 s at most
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused (unauthenticated)")]
    assert 1 <= len(said) <= windows, (len(said), windows)
    assert server.service.status().refused == {"unauthenticated": 300}


def test_right_token_is_accepted(started):
    config = run_config()
    server, client = started(config, token="s3cret")
    assert _seeded(client, config).versions == {0: -1, 1: -1}  # versions as of the join


def _self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_connection_works(tmp_path):
    config = run_config()
    cert, key = _self_signed(tmp_path)
    server = SynchronizerServer(Synchronizer(config), tls_cert=cert, tls_key=key).start()
    try:
        with SynchronizerClient(server.address, tls_root_cert=cert) as client:
            _seeded(client, config)
            assert _push(client, config, 0, 0, torch.zeros(layout(config).fragment_numel(0))).round == 0
            assert wait_for_version(client.pull, 0, 1)[0] == 1
        with SynchronizerClient(server.address, max_retries=0) as plaintext:
            with pytest.raises(SynchronizerError) as err:
                plaintext.join(0, 1, SPECS)
            assert "serves TLS and this client connected in plaintext" in str(err.value)  # not only "Socket closed"
    finally:
        server.stop(grace=0)
    plain = SynchronizerServer(Synchronizer(config)).start()
    try:
        with SynchronizerClient(plain.address, tls_root_cert=cert, max_retries=0) as tls:
            with pytest.raises(SynchronizerError) as err:
                tls.join(0, 1, SPECS)
            assert "serves plaintext and this client connected with TLS" in str(err.value)
    finally:
        plain.stop(grace=0)


def test_shards_own_their_fragments_and_the_client_routes_by_fragment():
    config = run_config(num_fragments=2)
    servers = [SynchronizerServer(Synchronizer(config, SynchronizerSettings(shard=i, num_shards=2))).start() for i in range(2)]
    try:
        with SynchronizerClient([s.address for s in servers]) as client:
            info = _seeded(client, config)
            assert info.versions == {0: -1, 1: -1}
            numel = layout(config).fragment_numel(1)
            _push(client, config, 0, 1, torch.zeros(numel))
            assert wait_for_version(client.pull, 1, 1)[0] == 1
            assert servers[0].service.versions() == {0: 0}
            assert servers[1].service.versions() == {1: 1}
            assert client.heartbeat(0, 1, 0.1).versions == {0: 0, 1: 1}
    finally:
        for s in servers:
            s.stop(grace=0)


def test_learners_carry_on_after_a_synchronizer_restart_from_checkpoint(tmp_path):
    config = run_config()
    service = Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, checkpoint_every=1))
    server = SynchronizerServer(service).start()
    port = server.port
    client = SynchronizerClient(server.address, max_retries=20, backoff=0.05, max_backoff=0.2)
    events = Events()
    restarted = {}
    try:
        _seeded(client, config)
        events.subscribe(client, 0, {0: 0, 1: 0})
        numel = layout(config).fragment_numel(0)
        for v in range(2):
            _push(client, config, 0, 0, torch.full((numel,), 0.01), round=v, base_version=v, seq=v)
            events.version(0, v + 1)
        before = client.pull(0)
        events_before_restart = len(events.versions)
        server.stop(grace=0)  # checkpoints on the way down

        def restart_soon():
            time.sleep(0.5)
            resumed = Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path))
            restarted["resumed"] = resumed.pull(0)  # before anything lands on it: the checkpoint's
            restarted["server"] = SynchronizerServer(resumed, port=port).start()

        thread = threading.Thread(target=restart_soon, name="diloco-test-restart")
        thread.start()
        # this push fails while the synchronizer is down, then rejoins and lands
        ack = _push(client, config, 0, 0, torch.full((numel,), 0.01), round=2, base_version=2, seq=2)
        thread.join()
        assert (ack.round, ack.late) == (2, False)
        assert events.version(0, 3).round == 2  # the subscription reopened on the new process
        assert events.reconnects >= 1
        # on a new incarnation the island's versions are no base (numbers past the checkpoint get
        # reissued): it was sent full values first
        events.first(lambda e: e.fragment == 1 and e.base_version == -1, "full values of fragment 1 after the restart",
                     after=events_before_restart)
        after_restart = restarted["server"].service
        assert after_restart.run.state.fragments[0].version == 3
        assert restarted["resumed"][0] == 2 and torch.equal(before[1], restarted["resumed"][1])
    finally:
        client.close()
        server.stop(grace=0)
        if "server" in restarted:
            restarted["server"].stop(grace=0)


class CountedJoins(Synchronizer):
    """A synchronizer whose joins are counted and slow, so every thread of a client notices the
    restart while the first rejoin is still under way."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.joined: list[int] = []

    def join(self, island, world_size, specs, **kwargs):
        self.joined.append(island)
        time.sleep(0.3)
        return super().join(island, world_size, specs, **kwargs)


def test_a_synchronizer_restart_noticed_by_push_heartbeat_and_subscription_costs_exactly_one_join(tmp_path):
    config = run_config()
    server = SynchronizerServer(Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path))).start()
    client = SynchronizerClient(server.address, max_retries=20, backoff=0.05, max_backoff=0.2)
    events, restarted = Events(), None
    try:
        _seeded(client, config)
        events.subscribe(client, 0, {0: 0, 1: 0})
        server.stop(grace=0)  # checkpoints on the way down
        restarted = SynchronizerServer(CountedJoins(config, SynchronizerSettings(checkpoint_dir=tmp_path)), port=server.port).start()
        numel = layout(config).fragment_numel(0)
        callers = [
            threading.Thread(target=client.heartbeat, args=(0, 5, 0.1, 5), name="diloco-test-heartbeat"),
            threading.Thread(target=_push, args=(client, config, 0, 0, torch.full((numel,), 0.01)), name="diloco-test-push"),
        ]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in callers)
        events.version(0, 1)  # the subscription reopened with the one new session and carries on
        assert restarted.service.joined == [0]
        assert restarted.service.status().accepted.get("on_time") == 1
    finally:
        client.close()
        server.stop(grace=0)
        if restarted is not None:
            restarted.stop(grace=0)


def test_an_island_started_before_its_synchronizer_waits_and_joins(caplog):
    with socket.socket() as probe:  # a port nothing listens on yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = run_config()
    client = SynchronizerClient(f"127.0.0.1:{port}", max_retries=0, backoff=0.05, max_backoff=0.2)
    started: dict = {}

    def start_later():
        time.sleep(1.0)
        started["server"] = SynchronizerServer(Synchronizer(config), port=port).start()

    thread = threading.Thread(target=start_later, name="diloco-test-late-start")
    try:
        with pytest.raises(SynchronizerError) as refused:  # no patience: fails at once, saying why
            client.join(0, 1, SPECS)
        assert refused.value.reason == "unreachable"
        thread.start()
        began = time.monotonic()
        with caplog.at_level("WARNING", logger="lightning_diloco.transport.island_link"):
            info = client.join(0, 1, SPECS, patience=30.0)
        assert info.config == config
        assert f"no synchronizer reachable at 127.0.0.1:{port} yet" in caplog.text  # says why it waits
        assert time.monotonic() - began < 10.0  # joined once the synchronizer was up, not at the deadline
    finally:
        if thread.ident is not None:
            thread.join()
        client.close()
        if "server" in started:
            started["server"].stop(grace=0)


def test_sixteen_concurrent_learners_merge_exactly_like_the_reference(started):
    islands, rounds = 16, 6
    config = run_config(num_fragments=2, min_quorum=islands, uplink="fp32", downlink="fp32")
    server, client = started(config)
    clients = [SynchronizerClient(server.address) for _ in range(islands)]
    try:
        _seeded(clients[0], config, island=0)
        for i in range(1, islands):
            clients[i].join(i, 1, SPECS)
        lay = layout(config)

        def delta_of(island, fragment, r):
            g = torch.Generator().manual_seed(island * 1000 + fragment * 100 + r)
            return torch.randn(lay.fragment_numel(fragment), generator=g) * 0.01

        errors = []

        def learner(i):
            try:
                for r in range(rounds):
                    for p in range(2):
                        ack = _push(clients[i], config, i, p, delta_of(i, p, r), round=r, base_version=r, seq=r,
                                    tokens=50.0 * (i + 1), steps=4)
                        assert ack.round == r and not ack.late
                    for p in range(2):  # every round waits for all 16: the next base is version r + 1
                        assert wait_for_version(clients[i].pull, p, r + 1)[0] == r + 1
            except Exception as err:  # reported below
                errors.append(err)

        threads = [threading.Thread(target=learner, args=(i,), name=f"diloco-test-learner-{i}") for i in range(islands)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors

        weights = [contribution_weight(50.0 * (i + 1), 4) for i in range(islands)]
        for p in range(2):
            specs = lay.fragment_specs(p)
            reference = initial_fragments(config)[p].clone()
            outer = OuterOptimizer(reference, config.outer)
            for r in range(rounds):
                outer_gradients = [-delta_of(i, p, r) for i in range(islands)]
                # the guard's rules (core/guard.py): weights capped at 1.4x the round's lower median, then by agreement
                merged = merge_outer_gradients([split_fragment(o, specs) for o in outer_gradients],
                                               agreeing(capped_weights(weights), outer_gradients), [s.role for s in specs], "rda")
                outer.step(torch.cat([m.reshape(-1) for m in merged]))
            # the influence budget (core/guard.py) trims the heaviest islands' entries where their
            # share over the window passes 1.5x the others': close to the reference, not equal
            assert torch.allclose(clients[0].pull(p)[1], reference, atol=0.05)
    finally:
        for c in clients:
            c.close()


def test_a_push_or_seed_stream_without_a_header_is_refused_with_a_reason(started):
    """The chunk readers (transport/wire.py) read a missing header as protobuf does, all defaults,
    so such a stream gets a refusal naming its reason, not an unhandled error."""
    config = run_config()
    server, client = started(config)
    _seeded(client, config)
    stub = client.stubs[0]
    for call, chunk in [(stub.Push, pb.PushChunk(data=b"\0" * 16)), (stub.Seed, pb.FragmentChunk(data=b"\0" * 16))]:
        with pytest.raises(grpc.RpcError) as err:
            call(iter([chunk]), timeout=5)
        assert err.value.code() != grpc.StatusCode.UNKNOWN and ":" in err.value.details(), err.value.details()
    assert server.service.versions() == {0: 0, 1: 0}


def test_a_client_closed_while_it_joins_again_says_it_is_closed(started, monkeypatch):
    """A call refused for a stale session joins again first; an island that closed its client at
    that moment (its run ending) got gRPC's bare closed-channel ValueError from the call."""
    config = run_config(num_fragments=2)
    server, client = started(config)
    _seeded(client, config)
    server.service.join(0, 1, SPECS)  # the island joined elsewhere: this client's session is stale
    rejoin = client.shard_sessions.rejoin

    def close_then_rejoin(shard, joins):
        client.close()
        rejoin(shard, joins)

    monkeypatch.setattr(client.shard_sessions, "rejoin", close_then_rejoin)
    with pytest.raises(SynchronizerError) as refused:
        client.heartbeat(0, 1, 0.1, 1)
    assert refused.value.reason == Reason.UNREACHABLE and "closed" in str(refused.value)


def test_a_close_ends_a_call_backing_off_from_an_absent_synchronizer_at_once():
    """close() ended nothing a call waited on between its retries: a join with patience against a
    synchronizer that is away raised 'closed' only once its backoff (up to max_backoff) was over.
    Here that backoff is 5 to 10 minutes; the call must end long before."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = SynchronizerClient(f"127.0.0.1:{port}", max_retries=0, backoff=600.0, max_backoff=600.0)
    backing_off, outcome = threading.Event(), {}

    class Waiting(logging.Handler):  # the warning logged right before its first backoff
        def emit(self, record):
            if "no synchronizer reachable" in record.getMessage():
                backing_off.set()

    def join():
        try:
            client.join(0, 1, SPECS, patience=3600.0)
        except SynchronizerError as err:
            outcome["error"] = err

    handler, logger = Waiting(), logging.getLogger("lightning_diloco.transport.island_link")
    logger.addHandler(handler)
    thread = threading.Thread(target=join, name="diloco-test-backing-off")
    try:
        thread.start()
        assert backing_off.wait(60), "the join never backed off"
        client.close()
        thread.join(timeout=120)
        assert not thread.is_alive(), "the join waited out its backoff after the client was closed"
        assert outcome["error"].reason == Reason.UNREACHABLE and "closed" in str(outcome["error"])
    finally:
        logger.removeHandler(handler)
        client.close()
        thread.join(timeout=600)


def test_a_second_process_as_a_running_island_is_refused_and_the_running_one_keeps_its_session():
    """Two processes started as island 0 took its session from each other on every call
    (wrong_session both ways). The second is refused, saying island 0 runs; the first goes on."""
    config = run_config()
    with SynchronizerServer(Synchronizer(config)) as server:
        running, second = SynchronizerClient(server.address), SynchronizerClient(server.address)
        second.running_patience = 0.0  # refused at once, not after the retries a restarted island waits through
        try:
            running.join(0, 1, SPECS, num_islands=2)
            running.heartbeat(0, 1, 0.1)
            with pytest.raises(SynchronizerError) as err:
                second.join(0, 1, SPECS, num_islands=2)
            assert err.value.reason == Reason.ISLAND_RUNNING and "island 0 is already running" in str(err.value)
            assert "to restart island 0, stop its running process" in str(err.value)
            running.heartbeat(0, 2, 0.1)
            assert running.shard_sessions.joins == [1]  # not displaced: no rejoin was needed
            running.shard_sessions.rejoin(0, running.shard_sessions.joins[0])  # its own client joining again (a shard back) is no second process
            assert running.shard_sessions.joins == [2]
        finally:
            running.close()
            second.close()


def test_an_island_started_with_another_num_islands_is_refused_naming_both_over_grpc():
    with SynchronizerServer(Synchronizer(run_config(), SynchronizerSettings(num_islands=2))) as server:
        with SynchronizerClient(server.address) as first, SynchronizerClient(server.address) as other:
            first.join(0, 1, SPECS, num_islands=2)
            with pytest.raises(SynchronizerError) as err:
                other.join(1, 1, SPECS, num_islands=3)
    assert err.value.reason == Reason.NUM_ISLANDS_MISMATCH and err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "started with num_islands=3, but the run has num_islands=2" in str(err.value)


def test_an_island_restarted_after_a_crash_gets_in_once_its_old_process_is_silent():
    """A crashed island's restart is refused while its old session may still be running, and its
    client retries until the old one has been silent for the window (here 1 s: the liveness
    timeout's, which bounds it)."""
    with SynchronizerServer(Synchronizer(run_config(), SynchronizerSettings(liveness_timeout=1.0))) as server:
        crashed = SynchronizerClient(server.address)
        crashed.join(0, 1, SPECS)
        crashed.heartbeat(0, 1, 0.1)
        crashed.close()  # as a SIGKILL leaves it: no goodbye
        with SynchronizerClient(server.address) as restarted:
            assert restarted.join(0, 1, SPECS).session
            assert restarted.heartbeat(0, 2, 0.1).run_step >= 0


def test_an_island_that_left_is_let_in_again_at_once_and_a_leave_to_a_synchronizer_gone_fails_as_unreachable(started):
    """A left island is not running: its restart (a new process, another client) is not refused
    as island_running, as a killed one's is until it has been silent. A leave is one attempt: the
    synchronizer gone, it fails as unreachable instead of retrying, and the island ends anyway."""
    server, client = started(run_config())
    client.join(0, 1, SPECS)
    client.leave(0)
    with SynchronizerClient(server.address, max_retries=0) as restarted:
        assert restarted.join(0, 1, SPECS).session
        assert server.service.live_islands() == {0}
        server.stop(grace=0)
        with pytest.raises(SynchronizerError) as err:
            restarted.leave(0)
    assert err.value.reason == Reason.UNREACHABLE and "leave of shard 0 failed" in str(err.value)


def test_a_pull_before_joining_says_the_client_has_not_joined_without_asking():
    with socket.socket() as s:  # a port no one listens on: the answer cannot come from a synchronizer
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with SynchronizerClient(f"127.0.0.1:{port}", max_retries=0) as client:
        with pytest.raises(SynchronizerError) as err:
            client.pull(0)
    assert err.value.reason == Reason.NOT_JOINED and "has not joined the run" in str(err.value) and "call join first" in str(err.value)


def test_an_island_of_another_num_islands_stops_saying_both_values():
    """What the user of the second island sees: its fit ends at the join, with both counts."""
    from lightning_diloco import DecoupledDiLoCoStrategy
    from lightning_diloco.core.fragments import tensor_specs
    from lightning_diloco.learner.island_membership import RefusedByRun
    from tests.learner.models import TinyRegressor, loader, regression_data, trainer

    with SynchronizerServer(Synchronizer(run_config(num_fragments=2), SynchronizerSettings(num_islands=2))) as server:
        with SynchronizerClient(server.address) as first:
            first.join(0, 1, tensor_specs(TinyRegressor()), num_islands=2)
            strategy = DecoupledDiLoCoStrategy(synchronizer=server.address, island=1, num_islands=3, join_wait=5)
            with pytest.raises(RefusedByRun) as err:
                trainer(strategy, max_steps=2).fit(TinyRegressor(), loader(regression_data()))
    assert "(num_islands_mismatch)" in str(err.value)
    assert "island 1 was started with num_islands=3, but the run has num_islands=2" in str(err.value)
