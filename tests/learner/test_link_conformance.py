"""One exchange against every link an island can hold: the gRPC client (a remote synchronizer),
the in-process link (an embedded one, synchronizer/local_link.py), and that link with the fault
switches the island tests use (tests/learner/service_link.py). An island must not be able to
tell them apart: whatever the in-process links answered differently from the client would train
one-process runs differently, and make the island tests prove the wrong thing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_diloco.core import readers
from lightning_diloco.core.codecs import get_codec, payload_size
from lightning_diloco.core.protocol import RUNNING_WINDOW, Beat, Contribution, PushAck
from lightning_diloco.learner.link import SynchronizerLink
from lightning_diloco.reasons import Reason, SynchronizerError
from lightning_diloco.synchronizer.local_link import LocalLink
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.transport.client import SynchronizerClient
from tests.helpers import SPECS, initial_fragments, layout, run_config
from tests.learner.service_link import ServiceLink

CONFIG = run_config(num_fragments=2)


class Clock:
    """The monotonic clock, which a test can move ahead (``ahead`` seconds)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


@pytest.fixture(params=["grpc client", "in-process link", "in-process test double"])
def link(request):
    service = Synchronizer(CONFIG, SynchronizerSettings(clock=Clock()))
    if request.param == "grpc client":
        server = SynchronizerServer(service, host="127.0.0.1", port=0).start()
        client = SynchronizerClient(server.address)
        yield client, service
        client.close()
        server.stop(grace=0)
    else:
        service.start()
        local = LocalLink(service) if request.param == "in-process link" else ServiceLink(service)
        yield local, service
        local.close()
        service.shutdown()


def _push(link, delta, *, seq, layout_hash=None):
    return link.push(Contribution(island=0, fragment=0, round=0, base_version=0, tokens=100.0, steps=4, codec="fp32", seq=seq,
                     payload=get_codec("fp32").encode(delta), layout_hash=layout_hash or layout(CONFIG).hash))


def test_every_link_answers_an_exchange_alike(link):
    link, _ = link
    assert isinstance(link, SynchronizerLink)
    info = link.join(0, 1, SPECS, patience=1.0)
    assert info.config == CONFIG and info.layout_hash == layout(CONFIG).hash and info.versions == {0: -1, 1: -1}
    beat = link.heartbeat(0, 0, 0.0, 0)
    assert isinstance(beat, Beat) and beat.versions == {0: -1, 1: -1} and beat.run_step == 0

    values = initial_fragments(CONFIG)
    assert link.seed(0, 0, values[0]) == (True, 0)
    assert link.seed(0, 0, values[0] + 1) == (False, 0)  # the first offer wins
    assert link.seed(0, 1, values[1]) == (True, 0)
    version, value = link.pull(0)
    assert version == 0 and torch.equal(value, values[0])

    events, arrived = [], threading.Event()

    def on_version(event):
        events.append(event)
        arrived.set()

    link.subscribe(0, lambda: {0: 0, 1: 0}, on_request=lambda *r: None, on_version=on_version)
    delta = torch.full_like(values[0], 0.5)
    ack = _push(link, delta, seq=1)
    assert ack == PushAck(fragment=0, round=0, late=False, duplicate=False, version=0)
    assert _push(link, delta, seq=1).duplicate  # a retry is answered, never merged twice
    assert arrived.wait(20), "no new version reached the subscription"
    event = events[0]
    assert (event.fragment, event.version, event.base_version, event.round, event.included) == (0, 1, -1, 0, True)
    assert event.codec == CONFIG.codec.downlink and payload_size(event.payload) == 4 * values[0].numel()
    version, value = link.pull(0)
    assert version == 1 and not torch.equal(value, values[0])
    assert torch.equal(get_codec(event.codec).decode(event.payload, value.numel()), value)  # fp32: the value whole

    with pytest.raises(SynchronizerError) as refused:
        _push(link, delta, seq=2, layout_hash="another model")
    assert refused.value.reason == Reason.LAYOUT_MISMATCH and "rejoin with the run's model" in str(refused.value)


def _joined_and_seeded(link):
    link.join(0, 1, SPECS)
    for p, value in initial_fragments(CONFIG).items():
        link.seed(0, p, value)


@pytest.mark.parametrize("payload, reason", [
    (lambda numel: torch.full((numel,), float("nan")).view(torch.uint8), Reason.NON_FINITE),  # fp32 NaNs
    (lambda numel: torch.zeros(4 * numel - 1, dtype=torch.uint8), Reason.BAD_PAYLOAD),  # a byte short
], ids=["non-finite", "wrong size"])
def test_every_link_refuses_a_bad_payload_with_the_servers_reason(link, payload, reason):
    link, service = link
    _joined_and_seeded(link)
    payload = payload(layout(CONFIG).fragment_numel(0))
    with pytest.raises(SynchronizerError) as refused:
        link.push(Contribution(island=0, fragment=0, round=0, base_version=0, tokens=100.0, steps=4, codec="fp32", seq=1,
                  payload=payload, layout_hash=layout(CONFIG).hash))
    assert refused.value.reason == reason
    assert service.tally.refused[reason.value] == 1 and service.versions()[0] == 0  # counted, nothing merged


def test_every_link_refuses_an_islands_calls_before_it_joined(link):
    """The in-process link trusted a link that never joined: its pull of a run seeded by another
    island was answered, where the client's is refused. One link stack: refused alike."""
    link, service = link
    service.join(1, 1, SPECS)
    for p, value in initial_fragments(CONFIG).items():
        service.seed(1, p, get_codec("fp32").encode(value))
    for call in (lambda: link.pull(0), lambda: link.heartbeat(0, 1, 0.1, 1), lambda: _push(link, torch.zeros(1), seq=1)):
        with pytest.raises(SynchronizerError) as refused:
            call()
        assert refused.value.reason == Reason.NOT_JOINED and "call join first" in str(refused.value)


def test_every_link_joins_again_when_its_island_joined_elsewhere(link):
    """Another join as the same island ends this link's session: its next call joins again and
    goes through, and its subscription is reopened (said through on_reconnect), as the client's."""
    link, service = link
    _joined_and_seeded(link)
    opened, reopened = threading.Event(), threading.Event()
    # holding no version of fragment 0, the island is sent it whole: the stream is open
    link.subscribe(0, lambda: {0: -1, 1: 0}, on_request=lambda *r: None, on_version=lambda *v: opened.set(),
                   on_reconnect=reopened.set)
    assert opened.wait(20), "the subscription delivered nothing"
    service.join(0, 1, SPECS)
    # ... by a process that has been silent since (the process that took the session died): while
    # it is heard from, a client's join again is refused as island_running (test_grpc_synchronizer.py)
    service.clock.ahead += RUNNING_WINDOW + 1
    assert link.heartbeat(0, 1, 0.1, 1).versions == {0: 0, 1: 0}
    assert reopened.wait(20), "the subscription was not reopened after the island joined again"
    assert link.pull(1)[0] == 0


def test_every_link_leaves_the_run_and_does_not_join_again_by_itself(link):
    """A left island is out of the run at once: not live, said left in Status, its subscription
    ended. A refusal after that (the synchronizer no longer knows the island) is raised, not
    answered by joining again as before, which would put the island back into the run; a join is
    the island's own choice. A second leave is refused as the first one's island is not joined."""
    link, service = link
    _joined_and_seeded(link)
    opened = threading.Event()
    # holding no version of fragment 0, the island is sent it whole: the stream is open
    link.subscribe(0, lambda: {0: -1, 1: 0}, on_request=lambda *r: None, on_version=lambda *v: opened.set())
    assert opened.wait(20), "the subscription delivered nothing"
    link.leave(0)
    status = service.status()
    assert status.live_islands == [] and status.islands[0].left
    deadline = time.monotonic() + 20
    while _readers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _readers(), "the subscription still reads after the island left"
    for call in (lambda: link.heartbeat(0, 1, 0.1, 1), lambda: _push(link, torch.zeros(1), seq=9), lambda: link.leave(0)):
        with pytest.raises(SynchronizerError) as refused:
            call()
        assert refused.value.reason == Reason.NOT_JOINED
    assert service.status().islands[0].left  # not joined again by any of them
    link.join(0, 1, SPECS)
    assert service.status().live_islands == [0] and link.heartbeat(0, 1, 0.1, 1).versions == {0: 0, 1: 0}


def test_a_closed_link_ends_its_subscription_and_refuses_every_call(link):
    """Close ends a running subscription (its reader threads are joined when close returns), and
    later calls fail as unreachable, saying the link is closed. A subscribe after close used to
    start a reader that was never joined and retried the closed link for ever (the client's logged a
    closed-channel error at each try, the in-process link's a refusal); the client's status() and
    pull() raised gRPC's bare ValueError."""
    link, _ = link
    _joined_and_seeded(link)
    opened = threading.Event()
    # holding no version of fragment 0, the island is sent it whole: the stream is open
    link.subscribe(0, lambda: {0: -1, 1: 0}, on_request=lambda *r: None, on_version=lambda *v: opened.set())
    assert opened.wait(20), "the subscription delivered nothing"
    link.close()
    readers = [t.name for t in threading.enumerate() if t.name.startswith("diloco-subscription") and t.is_alive()]
    assert not readers, f"close returned with the subscription still reading: {readers}"
    threads = set(threading.enumerate())
    for call in (lambda: link.status(), lambda: link.heartbeat(0, 1, 0.1, 1), lambda: link.pull(0),
                 lambda: link.seed(0, 0, initial_fragments(CONFIG)[0]), lambda: _push(link, torch.zeros(1), seq=9),
                 lambda: link.join(0, 1, SPECS),
                 lambda: link.subscribe(0, lambda: {0: 0, 1: 0}, on_request=lambda *r: None,
                                        on_version=lambda *v: None)):
        with pytest.raises(SynchronizerError) as refused:
            call()
        assert refused.value.reason == Reason.UNREACHABLE and "closed" in str(refused.value)
    assert set(threading.enumerate()) <= threads, "a closed link started a thread"
    link.close()  # a second close (the caller's, then a context manager's) is harmless


def _held_subscription(link):
    """A live subscription whose reader is held inside ``on_version`` until the returned event is
    set; the versions it was handed. The island holds no version: it is sent both fragments."""
    _joined_and_seeded(link)
    inside, release, handed = threading.Event(), threading.Event(), []

    def on_version(update):
        handed.append(update)
        inside.set()
        release.wait()

    link.subscribe(0, lambda: {0: -1, 1: -1}, on_request=lambda *r: None, on_version=on_version)
    assert inside.wait(20), "the subscription delivered nothing"
    return release, handed


def _readers():
    return [t for t in threading.enumerate() if t.name.startswith("diloco-subscription") and t.is_alive()]


def test_two_closes_at_once_each_return_once_the_readers_ended(link, monkeypatch):
    """The first close took the subscriptions out of the link: a second close at the same time
    (an island's shutdown beside its context manager's) found none and returned at once, its
    readers still running."""
    link, _ = link
    monkeypatch.setattr(readers, "JOIN_TIMEOUT", 600.0)  # the reader is held by the test, not the clock
    release, _ = _held_subscription(link)
    running_when_returned, returned = {}, threading.Event()

    def close(name):
        link.close()
        running_when_returned[name] = [t.name for t in _readers()]
        returned.set()

    closers = [threading.Thread(target=close, args=(name,), name=f"diloco-test-close-{name}") for name in ("one", "two")]
    try:
        for thread in closers:
            thread.start()
        returned.wait(2.0)  # time for a close that does not wait for the held reader to return (none may)
    finally:
        release.set()
    for thread in closers:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in closers), "a close never returned"
    assert running_when_returned == {"one": [], "two": []}


def test_a_close_waits_for_a_blocked_callback_only_so_long_and_names_it_and_its_reader_hands_nothing_more(
        link, monkeypatch, caplog):
    """A callback blocked past the join timeout outlived close() silently: nothing said that a
    reader was still running, nor which callback held it."""
    link, _ = link
    monkeypatch.setattr(readers, "JOIN_TIMEOUT", 0.05)  # the callback is held by the test however long it takes
    release, handed = _held_subscription(link)
    try:
        with caplog.at_level("WARNING", logger="lightning_diloco.core.readers"):
            link.close()  # returns though the callback is still held
        [held] = _readers()
        [warning] = [r.getMessage() for r in caplog.records if r.name == "lightning_diloco.core.readers"]
        assert held.name in warning and "still running" in warning and "_held_subscription.<locals>.on_version" in warning
    finally:
        release.set()
    held.join(timeout=60)
    assert not held.is_alive(), "the reader did not end once its callback returned"
    assert len(handed) == 1  # the other fragment's version, sent too, was handed to nobody after the close
