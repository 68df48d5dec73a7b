"""Every RPC under the same resource rules (issue 35): what one island's credential, or anyone on
the HTTP ports, could make the synchronizer hold, and what an honest island notices now.

- Seeds take their island's payload stream slots, as pushes do (300 seeds trickling a byte every
  5 s took every worker), and a seed of a fragment already seeded is answered from its header,
  its payload never read (200 held ones cost 1.7 GB).
- A pull is a joined island's (an unjoined credential's 300 unread pulls held 1 GB), one island
  has 2 open at most, and one never read is cancelled at its deadline.
- The status page and the metrics port close idle connections and serve a few at once (1,030
  idle ones took every descriptor: joins timed out, checkpoints failed).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch

from lightning_diloco.core.fragments import TensorSpec
from lightning_diloco.core.protocol import Contribution
from lightning_diloco.reasons import Reason, SynchronizerError
from lightning_diloco.synchronizer import deadlines
from lightning_diloco.synchronizer.metrics import serve_metrics
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.slots import EXPORTS_AT_ONCE, OPERATOR, PULLS_PER_ISLAND
from lightning_diloco.synchronizer.status_page import serve_status_page
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport.client import SynchronizerClient
from lightning_diloco.transport.wire import stub
from tests.helpers import SPECS, initial_fragments, layout, run_config

WAIT_S = 30.0  # the most any wait below takes; each ends as soon as what it waits for is seen


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {WAIT_S} s"
        time.sleep(0.02)


def _specs_message(specs) -> list[pb.TensorSpec]:
    return [pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, role=s.role) for s in specs]


@pytest.fixture
def server_of():
    """``server_of(specs, seed=[fragments])``: a real server on port 0 whose island 0 (the
    honest client returned with it) joined and seeded only the fragments named."""
    made = []

    def make(specs, seed):
        config = run_config(num_fragments=2, min_quorum=1)
        server = SynchronizerServer(Synchronizer(config), max_workers=24).start()
        honest = SynchronizerClient(server.address, max_retries=1, backoff=0.05, timeout=10)
        made.append((server, honest))
        honest.join(0, 1, specs)
        numels = server.service.run.state.layout
        for p in seed:
            honest.seed(0, p, torch.zeros(numels.fragment_numel(p)))
        return server, honest

    yield make
    for server, honest in made:
        honest.close()
        server.stop(grace=0)


# ---- seeds --------------------------------------------------------------------------------------


def test_trickling_seeds_from_one_island_take_only_its_slots(server_of):
    """More seeds trickling in than the server has workers, for a fragment nobody seeded yet:
    the island's P + 2 payload slots are held, the rest refused busy at once, and the honest
    island's heartbeat, status, push and a newcomer's join are answered meanwhile."""
    server, honest = server_of(SPECS, seed=[0])
    attacker = SynchronizerClient(server.address, max_retries=0)
    attacker.join(1, 1, SPECS)
    numel = layout(server.service.run.config).fragment_numel(1)
    head = pb.FragmentHeader(fragment=1, island=1, codec="fp32", payload_bytes=numel * 4, session=attacker.sessions[0])
    hung = threading.Event()

    def header_then_trickle():
        yield pb.FragmentChunk(header=head, data=b"\0")
        hung.wait(WAIT_S)  # a byte every few seconds, as the attack sent

    slots = server.service.run.config.schedule.num_fragments + 2
    calls = [attacker.stubs[0].Seed.future(header_then_trickle(), timeout=60) for _ in range(40)]  # 24 workers
    try:
        _wait_until(lambda: sum(c.done() for c in calls) >= len(calls) - slots, "refused")
        refused = [c for c in calls if c.done()]
        assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in refused)
        assert refused[0].details().startswith("busy: island 1 already holds") and "retry once one has ended" in refused[0].details()
        assert server.servicer.slots.held[(1, "payload")] == slots
        honest.heartbeat(0, 1, 0.1)
        honest.status()
        ack = honest.push(Contribution(island=0, fragment=0, round=0, base_version=0, tokens=100.0, steps=4, codec="fp32", seq=1,
                          payload=torch.zeros(layout(server.service.run.config).fragment_numel(0) * 4, dtype=torch.uint8),
                          layout_hash=layout(server.service.run.config).hash))
        assert ack.round == 0
        with SynchronizerClient(server.address, max_retries=0, timeout=10) as newcomer:
            assert newcomer.join(5, 1, SPECS).layout_hash
    finally:
        hung.set()
        attacker.close()


def test_a_seed_of_a_seeded_fragment_is_answered_before_its_payload_is_sent(target):
    """The first offer won: a later seed is answered "not seeded, version v" from its header; the
    server never waits for (or reads) the payload, so held seeds of a seeded fragment cost nothing."""
    numel = layout(target.config).fragment_numel(0)
    head = pb.FragmentHeader(fragment=0, island=0, codec="fp32", payload_bytes=numel * 4, session=target.honest.sessions[0])
    payload_asked = threading.Event()
    hung = threading.Event()

    def header_only():
        yield pb.FragmentChunk(header=head)
        payload_asked.set()  # gRPC asks for the next message: the header is on its way
        hung.wait(WAIT_S)  # the payload is never sent while the reply is awaited
        yield pb.FragmentChunk(data=b"\0" * (numel * 4))

    try:
        reply = target.stub().Seed.future(header_only(), timeout=60).result(timeout=WAIT_S)
        assert not hung.is_set() and (reply.seeded, reply.version) == (False, 0)
    finally:
        hung.set()
    assert target.honest.seed(0, 1, initial_fragments(target.config)[1] + 1) == (False, 0)  # the client: unchanged


# ---- pulls --------------------------------------------------------------------------------------


def test_a_pull_from_an_island_that_did_not_join_is_refused_saying_to_join(target):
    stub = target.stub()
    with pytest.raises(grpc.RpcError) as err:
        next(stub.Pull(pb.PullRequest(fragment=0, island=7), timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details().startswith("not_joined: island 7 sent a pull before joining; call Join first")
    with pytest.raises(grpc.RpcError) as err:  # a joined island's id without its session
        next(stub.Pull(pb.PullRequest(fragment=0, island=0, session="guessed"), timeout=10))
    assert err.value.details().startswith("wrong_session")
    with SynchronizerClient(target.server.address, max_retries=0) as stranger:
        with pytest.raises(SynchronizerError) as refused:  # the client says so before any call
            stranger.pull(0)
        assert refused.value.reason == Reason.NOT_JOINED and "call join first" in str(refused.value)
    assert target.honest.pull(0)[0] == 0  # a joined island's pull carries its island and session


def test_unread_pulls_are_capped_per_island_and_cancelled_at_their_deadline(server_of, monkeypatch):
    """Pulls of an 8 MB fragment never read: the island has 2 open at most (the rest refused busy)
    while another island's pulls are served; and each is cancelled at its deadline, which drops the
    reply gRPC held for it and frees its slots, and the island pulls again."""
    big = [TensorSpec(name=f"w{i}", shape=(2_000_000,), dtype="float32", role="dense") for i in range(2)]
    server, honest = server_of(big, seed=[0, 1])
    attacker = SynchronizerClient(server.address, max_retries=0, timeout=10)
    attacker.join(1, 1, big)
    # a channel that never widens its receive window: the replies stay in the server's buffers
    channel = grpc.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
    pull = stub(channel).Pull
    request = pb.PullRequest(fragment=0, island=1, session=attacker.sessions[0])
    held = lambda: server.servicer.slots.held[(1, "pull")]  # noqa: E731
    unread = []
    try:
        # the cap, under the default deadline (tens of seconds): nothing ends on its own meanwhile
        unread += [pull(request, timeout=120) for _ in range(PULLS_PER_ISLAND)]
        _wait_until(lambda: held() == PULLS_PER_ISLAND, "holding its pulls")
        with pytest.raises(grpc.RpcError) as err:
            next(pull(request, timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.details().startswith("busy: island 1")
        assert honest.pull(1)[0] == 0  # another island is served meanwhile
        for call in unread:
            call.cancel()  # the client gives up: the slots come back
        _wait_until(lambda: held() == 0, "freed the slots of the cancelled pulls")

        # the deadline, lowered to 1 s: the server cuts them off, long before the client's own 120 s
        monkeypatch.setattr(deadlines, "PAYLOAD_GRACE_S", 1.0)
        monkeypatch.setattr(deadlines, "MIN_PAYLOAD_BYTES_PER_S", 1 << 40)  # the size adds nothing
        cancelled = server.servicer.deadlines.cancelled
        unread += [pull(request, timeout=120) for _ in range(PULLS_PER_ISLAND)]
        _wait_until(lambda: server.servicer.deadlines.cancelled == cancelled + PULLS_PER_ISLAND, "cancelled the unread pulls")
        _wait_until(lambda: held() == 0, "freed the slots")
        version, value = attacker.pull(0)  # the island pulls again, reading it
        assert version == 0 and value.numel() == 2_000_000
    finally:
        for call in unread:
            call.cancel()
        channel.close()
        attacker.close()


def test_unread_exports_are_capped_and_leave_the_islands_their_pulls(server_of):
    """The operator's exports of an 8 MB fragment never read: 2 open at most (the rest refused
    busy), in slots of their own, while an island's pulls are served; a cancelled one frees its slot."""
    big = [TensorSpec(name=f"w{i}", shape=(2_000_000,), dtype="float32", role="dense") for i in range(2)]
    server, honest = server_of(big, seed=[0, 1])
    channel = grpc.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)])
    export = stub(channel).ExportFragment
    request = pb.ExportFragmentRequest(fragment=0)
    held = lambda: server.servicer.slots.held[(OPERATOR, "export")]  # noqa: E731
    unread = []
    try:
        unread += [export(request, timeout=120) for _ in range(EXPORTS_AT_ONCE)]
        _wait_until(lambda: held() == EXPORTS_AT_ONCE, "holding its exports")
        with pytest.raises(grpc.RpcError) as err:
            next(export(request, timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.details().startswith("busy: the operator")
        assert honest.pull(1)[0] == 0 and server.service.status().islands.keys() == {0}  # the islands' calls go on
        for call in unread:
            call.cancel()
        _wait_until(lambda: held() == 0, "freed the slots of the cancelled exports")
    finally:
        for call in unread:
            call.cancel()
        channel.close()


# ---- the HTTP ports -----------------------------------------------------------------------------


def _idle(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(n)]


def _closed(s: socket.socket) -> bool:
    """The server closed it (without blocking: an open idle connection has nothing to read)."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=WAIT_S) as reply:
        reply.read()
        return reply.status


@pytest.mark.parametrize("port", ["status page", "metrics"])
def test_idle_http_connections_beyond_the_cap_are_closed_at_once(target, port):
    """With 4 connections held idle (an idle timeout longer than the test), 8 more are closed as
    soon as they are accepted, a new request too; the gRPC server still takes joins; once one of
    the idle clients goes, the page answers."""
    if port == "status page":
        server = serve_status_page(target.service.status, 0, idle_timeout=600, max_connections=4)
        path = "/"
    else:
        server, _ = serve_metrics(target.service, 0, idle_timeout=600, max_connections=4)
        path = "/metrics"
    url = f"http://127.0.0.1:{server.server_address[1]}{path}"
    sockets = _idle(server.server_address[1], 12)
    try:
        _wait_until(lambda: sum(_closed(s) for s in sockets) >= 8, "closed the connections beyond the cap")
        assert sum(not _closed(s) for s in sockets) == 4  # the ones served stay (their timeout is 600 s)
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # one more: closed unanswered
            _get(url)
        with SynchronizerClient(target.server.address, max_retries=0, timeout=10) as newcomer:
            assert newcomer.join(5, 1, SPECS).layout_hash
        for s in sockets:
            s.close()  # the idle clients go: their handlers see the end and free their slots

        def answers() -> bool:
            try:
                return _get(url) == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        _wait_until(answers, "answering")
    finally:
        for s in sockets:
            s.close()
        server.shutdown()
        server.server_close()


def test_idle_http_connections_are_closed_at_their_timeout_and_the_page_answers_again(target):
    server = serve_status_page(target.service.status, 0, idle_timeout=0.5, max_connections=4)
    port = server.server_address[1]
    sockets = _idle(port, 4)  # every slot taken, nothing sent
    try:
        for s in sockets:  # closed by the server (the blocking read returns at its end)
            s.settimeout(WAIT_S)
            assert s.recv(1) == b""
        assert _get(f"http://127.0.0.1:{port}/status.json") == 200
    finally:
        for s in sockets:
            s.close()
        server.shutdown()
        server.server_close()


def test_the_synchronizer_raises_its_descriptor_limit_to_the_hard_one():
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] == resource.RLIM_INFINITY:
        pytest.skip("no hard limit here to raise the soft one to")
    code = ("import resource; soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard)); "
            "from lightning_diloco.synchronizer.main import raise_open_files_limit; "
            "print(raise_open_files_limit() == (hard, hard), resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr
