"""One fragment on an island: what an apply does to its parameters, counters and flight, and its checkpoint form."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from lightning_diloco.core.config import ScheduleConfig
from lightning_diloco.core.fragments import DENSE, TensorSpec, build_layout
from lightning_diloco.core.protocol import PushAck
from lightning_diloco.learner.collective import Collective
from lightning_diloco.learner.fragment import Flight, IslandFragment, fragments_state_dict, load_fragments
from lightning_diloco.learner.inbox import Arrival
from lightning_diloco.learner.shards import IslandShards

SPECS = [TensorSpec(name="w", shape=(2,), dtype="float32", role=DENSE)]


def _fragment(mode: str, value: float = 0.0) -> tuple[IslandFragment, torch.Tensor]:
    """Fragment 0 of a one-tensor model on a one-rank island's leader, its base and parameter at ``value``."""
    param = torch.full((2,), value)
    shards = IslandShards([param], build_layout(SPECS, 1), Collective(), leader=True)
    return IslandFragment(0, shards, ScheduleConfig(num_fragments=1, apply=mode), shards.read(0)), param


def _sent(f: IslandFragment, *, merged_in: int, snapshot=None) -> Flight:
    """A send of ``f`` acked into round ``merged_in``."""
    future: Future[PushAck] = Future()
    future.set_result(PushAck(fragment=0, round=merged_in, late=False, duplicate=False, version=0))
    f.flight = Flight(round=merged_in, apply_at=0, snapshot=snapshot, tokens_at_send=f.tokens, steps_at_send=f.steps,
                      sent_at=0.0, future=future)
    f.sent_round = merged_in
    return f.flight


def _apply_whole(f: IslandFragment, value: float, version: int, round: int) -> int:
    """The leader takes and applies the whole global value ``value`` of round ``round``; returns the staleness."""
    arrival = Arrival(fragment=0, version=version, round=round, steps=(torch.full((2,), value),), base_version=-1,
                      included=False)
    return f.apply(f.take(arrival))


def test_rebase_keeps_the_progress_made_after_the_send_and_overwrite_starts_again():
    f, param = _fragment("rebase")
    for _ in range(4):
        f.stepped(10.0)
    _sent(f, merged_in=3, snapshot=torch.ones(2))  # the parameters were at 1 when sent ...
    param.fill_(1.5)  # ... and one more step moved them on while the send was in flight
    f.stepped(10.0)
    staleness = _apply_whole(f, 2.0, version=3, round=3)
    assert (f.tokens, f.steps, f.version, f.flight, staleness) == (10.0, 1, 3, None, 2)  # versions 1 and 2 skipped
    assert torch.equal(param, torch.full((2,), 2.5))  # the global value plus the progress since the send
    f, param = _fragment("overwrite")
    f.stepped(10.0)
    _sent(f, merged_in=4)
    _apply_whole(f, 3.0, version=4, round=4)
    assert (f.tokens, f.steps, f.flight) == (0.0, 0, None) and torch.equal(f.base, torch.full((2,), 3.0))
    assert torch.equal(param, torch.full((2,), 3.0))


def test_a_version_before_the_sends_round_leaves_the_flight_and_moves_its_snapshot():
    """Rebase: another round's version arrives while a send is in flight; the send's snapshot is
    moved by the same global change, so the progress it measures stays the island's own."""
    f, _ = _fragment("rebase")
    flight = _sent(f, merged_in=5, snapshot=torch.ones(2))
    assert _apply_whole(f, 0.5, version=1, round=4) == 0
    assert f.flight is flight and torch.equal(flight.snapshot, torch.full((2,), 1.5)) and f.version == 1


def test_a_late_send_is_replaced_by_a_send_for_its_round_and_an_on_time_one_blocks_every_send():
    """A late send waits for a next round that opens only when some island sends for it: held
    back, a lone island behind rounds opened by islands that left the run never sent again."""
    f, _ = _fragment("overwrite")
    assert not f.blocks_send(0)  # nothing in flight
    _sent(f, merged_in=7)
    assert f.blocks_send(8)  # on time: its round closes with it
    late: Future[PushAck] = Future()
    late.set_result(PushAck(fragment=0, round=7, late=True, duplicate=False, version=3))
    f.flight = Flight(round=5, apply_at=0, snapshot=None, tokens_at_send=1.0, steps_at_send=1, sent_at=0.0, future=late)
    assert not f.blocks_send(7) and not f.blocks_send(8)
    assert f.blocks_send(6)  # a send for an earlier round would be late again


def test_the_checkpoint_form_round_trips_without_flights():
    fragments = [_fragment("overwrite", 2.0)[0], _fragment("overwrite")[0]]
    fragments[0].version, fragments[0].sent_round, fragments[0].tokens, fragments[0].steps = 2, 5, 7.0, 3
    _sent(fragments[1], merged_in=3)
    back = [_fragment("overwrite")[0], _fragment("overwrite")[0]]
    load_fragments(back, fragments_state_dict(fragments))
    assert [(f.version, f.sent_round, f.tokens, f.steps, f.flight) for f in back] == [(2, 5, 7.0, 3, None), (0, 3, 0.0, 0, None)]
    assert torch.equal(back[0].base, fragments[0].base) and back[0].base is not fragments[0].base


def test_a_copy_taken_off_the_published_value_by_summed_steps_is_not_given_back_until_sent_whole():
    """An island that took summed steps (more than the inbox keeps apart, inbox.py) holds a value
    a restarted synchronizer's digest check refuses: it offers nothing (and an FSDP island does not
    gather it) until the fragment comes whole; the checkpoint keeps that."""
    f, _ = _fragment("overwrite", 1.0)
    assert f.held() == (0, f.base)
    summed = Arrival(fragment=0, version=3, round=3, steps=(torch.ones(2),), base_version=0, included=False, exact=False)
    f.apply(f.take(summed))
    assert f.version == 3 and f.held() is None and not f.may_give_back()
    later = Arrival(fragment=0, version=4, round=4, steps=(torch.ones(2),), base_version=3, included=False)
    f.apply(f.take(later))
    assert f.held() is None  # built on that copy: still off
    back = _fragment("overwrite")[0]
    load_fragments([back], fragments_state_dict([f]))
    assert back.held() is None
    _apply_whole(f, 2.0, version=5, round=5)
    assert f.held() == (5, f.base)


def test_the_version_held_sent_whole_replaces_the_base_and_keeps_the_progress_since_in_every_mode():
    """A copy off the published value by summed steps, corrected by the same version pulled whole
    (inbox.put_pulled): a second apply with the rule would mix the parameters again or, overwrite,
    drop the island's progress since; the parameters move by the base's error only, the counters
    and the flight stay, and the copy is offered back again."""
    for mode in ("overwrite", "mix", "rebase"):
        f, param = _fragment(mode, 1.0)
        summed = Arrival(fragment=0, version=3, round=3, steps=(torch.ones(2),), base_version=0, included=False,
                         exact=False)
        f.apply(f.take(summed))  # base 2, off the published 2.25
        param.fill_(2.5)  # the island's progress since
        f.stepped(10.0)
        flight = _sent(f, merged_in=4, snapshot=torch.full((2,), 2.5) if mode == "rebase" else None)
        assert f.held() is None
        assert _apply_whole(f, 2.25, version=3, round=-1) == 0
        assert torch.equal(param, torch.full((2,), 2.75)), mode  # 2.5 + (2.25 - 2)
        assert (f.version, f.flight, f.tokens, f.steps, f.exact) == (3, flight, 10.0, 1, True), mode
        assert f.held() == (3, f.base) and torch.equal(f.base, torch.full((2,), 2.25))
        if mode == "rebase":
            assert torch.equal(flight.snapshot, torch.full((2,), 2.75))  # the progress since the send stays 0
