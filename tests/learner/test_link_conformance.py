"""One exchange against both links an island can hold: the real gRPC client, and the in-process
double (tests/learner/service_link.py) that the island tests inject faults through. Whatever the
double answers differently from the client would make those tests prove the wrong thing."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.learner.link import SynchronizerLink
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.core.protocol import Beat, PushAck
from lightning_diloco.transport.client import SynchronizerClient, SynchronizerError
from tests.helpers import SPECS, initial_fragments, layout, run_config
from tests.learner.service_link import ServiceLink

CONFIG = run_config(num_fragments=2)


@pytest.fixture(params=["grpc client", "in-process double"])
def link(request):
    service = Synchronizer(CONFIG)
    if request.param == "grpc client":
        server = SynchronizerServer(service, host="127.0.0.1", port=0).start()
        client = SynchronizerClient(server.address)
        client.join(0, 1, SPECS)
        yield client
        client.close()
        server.stop(grace=0)
    else:
        service.start()
        service.join(0, 1, SPECS)
        double = ServiceLink(service)
        yield double
        double.close()
        service.shutdown()


def _push(link, delta, *, seq, layout_hash=None):
    return link.push(island=0, fragment=0, round=0, base_version=0, tokens=100.0, steps=4, codec="fp32", seq=seq,
                     payload=get_codec("fp32").encode(delta), layout_hash=layout_hash or layout(CONFIG).hash)


def test_both_links_answer_an_exchange_alike(link):
    assert isinstance(link, SynchronizerLink)
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
    assert (event.fragment, event.version, event.base_version, event.round, event.included) == (0, 1, 0, 0, True)
    assert isinstance(event.payload, bytearray) and event.codec == CONFIG.codec.downlink
    version, value = link.pull(0)
    assert version == 1 and not torch.equal(value, values[0])

    with pytest.raises(SynchronizerError) as refused:
        _push(link, delta, seq=2, layout_hash="another model")
    assert refused.value.reason == Reason.LAYOUT_MISMATCH and "rejoin with the run's model" in str(refused.value)
