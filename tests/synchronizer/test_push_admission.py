"""Push admission (synchronizer/push_admission.py): a push wrong in several ways is refused for the
first rule it breaks, in the documented order, and its payload is asked for only once its header
is admitted."""

from dataclasses import replace

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.synchronizer.requests import Refusal
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.helpers import SPECS, FakeClock, contribution, initial_fragments, layout, run_config

CONFIG = run_config()
NUMEL = layout(CONFIG).fragment_numel(0)
GOOD = torch.full((NUMEL,), 0.01)
NAN = torch.full((NUMEL,), float("nan")).numpy().tobytes()  # the codec refuses to encode it: as a client could send
NAN_1 = torch.full((layout(CONFIG).fragment_numel(1),), float("nan")).numpy().tobytes()
RIGHT_SIZE = NUMEL * 4

# each case breaks one rule and every later one it can: the earliest is the one refused
CASES = {
    "unknown_fragment": (dict(fragment=7, island=5, layout_hash="0" * 16, steps=0, seq=-1, codec="int3"), None),
    "not_joined": (dict(island=5, layout_hash="0" * 16, steps=0, seq=-1, codec="int3"), None),
    "layout_mismatch": (dict(layout_hash="0" * 16, steps=0, seq=-1, codec="int3"), None),
    "bad_counters": (dict(steps=0, seq=-1, codec="int3"), None),
    "bad_sequence": (dict(seq=-1, codec="int3"), 1),
    "unknown_codec": (dict(codec="int3"), 1),
    "bad_payload": (dict(payload=NAN), 1),  # the declared size, before the (non-finite) payload is read
    "non_finite": (dict(payload=NAN_1, fragment=1), None),  # fragment 1 is not seeded: decoded first
}


def _joined(seed_fragments=(0,)):
    sync = Synchronizer(CONFIG, SynchronizerSettings(clock=FakeClock()))
    sync.join(0, 1, SPECS)
    for p in seed_fragments:
        sync.seed(0, p, get_codec("fp32").encode(initial_fragments(CONFIG)[p]))
    return sync


@pytest.mark.parametrize("reason", list(CASES))
def test_a_push_is_refused_for_the_first_rule_it_breaks_and_its_payload_is_not_read_before(reason):
    sync = _joined()
    fields, declared = CASES[reason]
    received = []

    def receive(expected):
        received.append(expected)
        return fields.get("payload", get_codec("fp32").encode(GOOD))

    fragment = fields.get("fragment", 0)
    c = replace(contribution(CONFIG, 0, 0, GOOD), **{k: v for k, v in fields.items() if k != "payload"}, payload=b"")
    with pytest.raises(Refusal) as err:
        sync.push(c, declared_bytes=declared, receive=receive)
    assert err.value.reason == reason, str(err.value)
    assert sync.status().refused == {reason: 1}
    read = reason == "non_finite"
    assert received == ([layout(CONFIG).fragment_numel(fragment) * 4] if read else []), received
    if reason == "bad_payload":
        assert "declares 1 bytes" in str(err.value)


def test_an_unseeded_fragment_and_an_old_sequence_are_refused_after_the_payload_is_read():
    sync = _joined(seed_fragments=(0,))
    numel1 = layout(CONFIG).fragment_numel(1)
    with pytest.raises(Refusal) as err:
        sync.push(contribution(CONFIG, 0, 1, torch.zeros(numel1)))
    assert err.value.reason == "not_seeded"
    sync.push(contribution(CONFIG, 0, 0, GOOD, seq=5))
    with pytest.raises(Refusal) as err:
        sync.push(contribution(CONFIG, 0, 0, GOOD, seq=4))
    assert err.value.reason == "old_sequence"


def test_an_admitted_push_asks_for_its_payload_once_with_the_size_it_must_have():
    sync = _joined()
    received = []

    def receive(expected):
        received.append(expected)
        return get_codec("fp32").encode(GOOD)

    c = replace(contribution(CONFIG, 0, 0, GOOD), payload=b"")
    ack = sync.push(c, declared_bytes=RIGHT_SIZE, receive=receive)
    assert received == [RIGHT_SIZE] and ack.round == 0 and not ack.duplicate
    assert sync.status().accepted == {"on_time": 1} and sync.status().bytes_in == RIGHT_SIZE
