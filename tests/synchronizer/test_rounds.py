"""Rounds on the synchronizer's clock (docs/algorithm.md#rounds), driven by a fake clock: no sleeps, no threads."""

import dataclasses

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.fragments import split_fragment
from lightning_diloco.core.merge import contribution_weight, merge_outer_gradients
from lightning_diloco.core.outer import OuterOptimizer
from lightning_diloco.core.protocol import RoundRequest, VersionUpdate
from lightning_diloco.synchronizer.rounds import PEER_WAIT_S
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.helpers import SPECS, FakeClock, contribution, initial_fragments, layout, run_config, with_peer_votes


def _started(config, islands, clock=None, *, peer_votes=False, **kwargs):
    """``peer_votes``: a run past its first rounds (tests.helpers.with_peer_votes); without them
    an island's entry alone in a round waits for another island's."""
    clock = clock or FakeClock()
    sync = Synchronizer(config, SynchronizerSettings(clock=clock, **kwargs))
    for i in range(islands):
        sync.join(i, 1, SPECS)
    for p, value in initial_fragments(config).items():
        sync.seed(0, p, get_codec("fp32").encode(value))
    if peer_votes:
        with_peer_votes(sync, range(islands))
    return sync, clock


def _place(sync, clock, step, islands):
    """Put ``islands`` at schedule step ``step`` of the run's clock, as their heartbeats would
    (a place is reached at a bounded rate: give it the time)."""
    clock.advance(step / 1000 + 1)
    for i in islands:
        sync.heartbeat(i, 0, 0.0, schedule_step=step)


def _available(sync, island, versions):
    """The events a subscription has for ``island`` right now."""
    calls = iter([True, True])
    return list(sync.subscribe(island, versions, active=lambda: next(calls, False), tick=0.0))


def _numel(config, p=0):
    return layout(config).fragment_numel(p)


def test_a_round_closes_once_and_a_contribution_after_it_goes_into_the_next_round():
    config = run_config(min_quorum=1, gamma=0.0)
    sync, clock = _started(config, 2, peer_votes=True)
    _place(sync, clock, 5 * 4, [0, 1])
    first = sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.01), round=5, seq=1))
    assert (first.round, first.late) == (5, False) and sync.run.fragments[0].rounds.opened_at is not None  # it opened round 5
    [closed] = sync.poll()
    assert (closed.round, closed.version, closed.islands) == (5, 1, (0,))
    clock.advance(0.5)
    late = sync.push(contribution(config, 1, 0, torch.full((_numel(config),), 0.02), round=5, seq=1))
    assert (late.round, late.late) == (6, True)
    assert sync.poll() == [] and sync.versions()[0] == 1  # a late contribution never opens an extra round
    sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.01), round=6, base_version=1, seq=2))
    [closed] = sync.poll()
    assert (closed.round, closed.version, closed.islands, closed.late) == (6, 2, (0, 1), 1)
    assert sync.status().outer_steps == 2  # two rounds, two outer steps, with two islands and K = 1


def test_one_outer_step_per_round_whatever_the_quorum_and_arrival_order():
    for quorum in (1, 2, 3):
        config = run_config(min_quorum=quorum, gamma=0.0)
        sync, clock = _started(config, 3)
        for r in range(4):
            for i in range(3):  # islands out of phase: each sends a little after the other
                sync.push(contribution(config, i, 1, torch.full((_numel(config, 1),), 0.01 * (i + 1)), round=r,
                                       base_version=sync.versions()[1], seq=r))
                clock.advance(0.1)
                sync.poll()
        rounds = sync.status().rounds[1]
        assert rounds.closed <= 4 + 1 and sync.versions()[1] == rounds.closed, (quorum, rounds)
        assert rounds.merged_entries + rounds.open_contributors == 12, (quorum, rounds)


def test_the_grace_window_admits_an_island_inside_it():
    config = run_config(min_quorum=1, gamma=0.5, overlap=2)
    sync, clock = _started(config, 2, peer_votes=True)
    for i in (0, 1):
        sync.heartbeat(i, 10, 1.0)  # grace = 0.5 * (2 * 1.0 - 0 - sync) ~ 1 s
    sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.01), round=3))
    assert sync.poll() == []
    clock.advance(0.6)
    assert sync.poll() == []  # still inside the window
    sync.push(contribution(config, 1, 0, torch.full((_numel(config),), 0.02), round=3))
    [closed] = sync.poll()
    assert closed.islands == (0, 1) and "every live island" in closed.reason
    assert closed.grace_wait_s == pytest.approx(0.6)


@pytest.mark.parametrize("grace_slack, window", [("overlap", 1.0), ("round", 2.0)])
def test_the_grace_window_closes_the_round_without_a_slow_island(grace_slack, window):
    """gamma 0.5 of tau = 2 step times (the paper's slack), or of H = 4 (the default: the
    fragment's round); step time 1 s."""
    config = run_config(min_quorum=1, gamma=0.5, overlap=2, grace_slack=grace_slack)
    sync, clock = _started(config, 2, peer_votes=True)
    due = 3 * 4 + sync.run.offsets[0]
    _place(sync, clock, due, (0, 1))  # round 3 of fragment 0 is due on the run's clock (H = 4)
    for i in (0, 1):
        sync.heartbeat(i, due, 1.0, schedule_step=due)
    sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.01), round=3))
    clock.advance(window - 0.1)
    assert sync.poll() == []  # the slow island still has time
    clock.advance(0.1)
    [closed] = sync.poll()
    assert closed.islands == (0,) and "grace window elapsed" in closed.reason


def test_a_round_opened_by_an_island_ahead_of_the_run_waits_for_the_others_to_reach_it():
    """Island 0 is 2 steps ahead of the run's clock (step time 1 s) and opens round 3: the window
    (0.5 of H = 4 step times, about 2 s) counts from when the others reach its due step, so
    island 1, sending 3.5 s later, is on time (from the send, the window would have closed at
    2 s); never past the whole slack (about 4 s)."""
    config = run_config(min_quorum=1, gamma=0.5, overlap=2)
    sync, clock = _started(config, 2)
    due = 3 * 4 + sync.run.offsets[0]
    _place(sync, clock, due - 2, (0, 1))
    clock.advance(5.0)
    sync.heartbeat(0, due, 1.0, schedule_step=due)
    sync.heartbeat(1, due - 2, 1.0, schedule_step=due - 2)
    assert sync.run.run_step() == due - 2
    sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.01), round=3))
    clock.advance(3.5)
    assert sync.poll() == []
    sync.push(contribution(config, 1, 0, torch.full((_numel(config),), 0.02), round=3))
    [closed] = sync.poll()
    assert closed.islands == (0, 1) and closed.late == 0 and "every live island" in closed.reason


def test_no_merge_below_quorum_and_status_says_so():
    config = run_config(min_quorum=2)
    sync, clock = _started(config, 2)
    sync.push(contribution(config, 0, 0, torch.zeros(_numel(config)), round=0))
    clock.advance(100)
    sync.heartbeat(0, 1, 0.1)
    assert sync.poll() == [] and sync.versions()[0] == 0
    assert sync.status().rounds[0].open_contributors == 1


def test_an_island_whose_heartbeats_stopped_is_not_waited_for():
    config = run_config(min_quorum=1, gamma=0.9, overlap=3)
    sync, clock = _started(config, 2, liveness_timeout=5.0)
    sync.heartbeat(0, 10, 5.0)  # long steps: a grace window of up to 13.5 s if island 1 counted
    clock.advance(6.0)
    sync.heartbeat(0, 11, 5.0)  # island 0 stays alive, island 1 went silent
    sync.push(contribution(config, 0, 0, torch.zeros(_numel(config)), round=0))
    [closed] = sync.poll()
    assert "every live island" in closed.reason and sync.status().live_islands == [0]


def test_an_entry_alone_in_a_fragments_first_round_waits_for_another_live_islands_entry():
    """Before any other island's contribution is merged nothing bounds a lone entry but z x the
    fragment's own norm: a hostile island that sent first moved the model from 10 to 26 from its
    target before any honest send (the trust arena, seed 11). Its round now waits for a second
    island's entry, which bounds it; an island alone in the run is not kept waiting."""
    config = run_config(min_quorum=1, gamma=0.0, num_fragments=1)
    sync, clock = _started(config, 2)
    numel, start = _numel(config), sync.pull(0)[1]
    honest = torch.full((numel,), 0.01)
    sync.push(contribution(config, 1, 0, -1000.0 * honest, round=0))
    assert sync.poll() == [] and sync.versions()[0] == 0
    sync.push(contribution(config, 0, 0, honest, round=0))
    [closed] = sync.poll()
    assert closed.islands == (0, 1)
    moved = float((sync.pull(0)[1] - start).norm())
    assert moved <= 0.7 * 1.9 * 1.4 * float(honest.norm())  # lr x Nesterov's first step x the peer bound
    # once a peer's contribution is on record, an entry alone in its round closes as before
    sync.push(contribution(config, 1, 0, honest, round=1, base_version=1, seq=1))
    assert [c.islands for c in sync.poll()] == [(1,)]
    alone, _ = _started(config, 1)  # nobody else in the run: nothing to wait for
    alone.push(contribution(config, 0, 0, honest, round=0))
    assert [c.islands for c in alone.poll()] == [(0,)]


@pytest.mark.parametrize("step_time", [0.5, 0.0])
def test_a_live_island_that_never_sends_holds_a_first_round_no_longer_than_a_round(step_time):
    """The wait for a peer is bounded: H step times, or PEER_WAIT_S before any step time is known."""
    config = run_config(min_quorum=1, gamma=0.0, num_fragments=1)
    sync, clock = _started(config, 2)
    for island in (0, 1):
        sync.heartbeat(island, 1, step_time)
    sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.01), round=0))
    wait = 4 * step_time if step_time else PEER_WAIT_S
    clock.advance(0.9 * wait)
    sync.heartbeat(1, 2, step_time)  # live, and silent
    assert sync.poll() == []
    clock.advance(0.2 * wait)
    assert [c.islands for c in sync.poll()] == [(0,)]


def test_a_late_contribution_is_measured_against_its_own_base_and_discounted_by_age():
    config = run_config(min_quorum=1, gamma=0.0, num_fragments=1, staleness_discount=1.0)
    sync, clock = _started(config, 2, peer_votes=True)
    numel = _numel(config)
    g = torch.Generator().manual_seed(7)
    d0, d1, d_late = (torch.randn(numel, generator=g) * 0.01 for _ in range(3))
    sync.push(contribution(config, 0, 0, d0, round=0, seq=0, tokens=100.0, steps=4))
    sync.poll()  # version 1
    late = sync.push(contribution(config, 1, 0, d_late, round=0, base_version=0, seq=0, tokens=100.0, steps=4))
    assert late.late
    sync.push(contribution(config, 0, 0, d1, round=1, base_version=1, seq=1, tokens=100.0, steps=4))
    sync.poll()  # version 2: island 0 on time, island 1's late contribution (base 0, age 1)

    specs = layout(config).fragment_specs(0)
    roles = [s.role for s in specs]
    reference = initial_fragments(config)[0].clone()
    outer = OuterOptimizer(reference, config.outer)
    outer.step(torch.cat([m.reshape(-1) for m in merge_outer_gradients([split_fragment(-d0, specs)], [1.0], roles)]))
    weights = [contribution_weight(100.0, 4), contribution_weight(100.0, 4, age=1, staleness_discount=1.0)]
    merged = merge_outer_gradients([split_fragment(-d1, specs), split_fragment(-d_late, specs)], weights, roles)
    outer.step(torch.cat([m.reshape(-1) for m in merged]))
    assert torch.allclose(sync.pull(0)[1], reference, atol=1e-6)


def test_rounds_nobody_sent_for_are_skipped_not_stepped():
    config = run_config(min_quorum=1, gamma=0.0)
    sync, clock = _started(config, 1)
    sync.push(contribution(config, 0, 0, torch.zeros(_numel(config)), round=2, seq=0))
    sync.poll()
    _place(sync, clock, 9 * 4, [0])
    ack = sync.push(contribution(config, 0, 0, torch.zeros(_numel(config)), round=9, base_version=1, seq=1))
    assert (ack.round, ack.late) == (9, False)
    [closed] = sync.poll()
    assert (closed.round, closed.version) == (9, 2)


def test_a_newer_send_for_the_same_round_supersedes_the_older_one():
    config = run_config(min_quorum=2, gamma=0.0)
    sync, _ = _started(config, 2)
    sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.01), round=0, seq=1))
    sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.02), round=0, seq=2))  # a restarted island
    sync.push(contribution(config, 1, 0, torch.full((_numel(config),), 0.02), round=0, seq=1))
    [closed] = sync.poll()
    assert closed.islands == (0, 1) and sync.status().rounds[0].superseded == 1
    assert sync.status().rounds[0].merged_entries == 2


def test_a_non_contributor_receives_every_new_version_as_the_value_it_is_to_hold():
    config = run_config(min_quorum=1, gamma=0.0, downlink="fp32")
    sync, _ = _started(config, 2, peer_votes=True)
    assert _available(sync, 1, {0: 0, 1: 0}) == []  # nothing new yet
    sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.01), round=0))
    sync.poll()
    [update] = _available(sync, 1, {0: 0, 1: 0})
    assert isinstance(update, VersionUpdate) and (update.fragment, update.version, update.base_version) == (0, 1, -1)
    assert update.round == 0 and not update.included
    assert torch.equal(get_codec("fp32").decode(update.payload, _numel(config)), sync.pull(0)[1])  # fp32: whole, exact
    [mine] = _available(sync, 0, {0: 0, 1: 0})
    assert mine.included  # the contributor learns its work is in
    [full] = _available(sync, 1, {0: 7, 1: 0})  # a version the synchronizer never issued: the full value
    assert full.base_version == -1 and torch.equal(get_codec("fp32").decode(full.payload, _numel(config)), sync.pull(0)[1])


def test_a_round_opening_asks_every_other_live_island_to_send_now():
    config = run_config(min_quorum=1, gamma=0.5, overlap=2)  # H = 4; fragment 1 is due at offset 0
    sync, clock = _started(config, 3)
    _place(sync, clock, 6 * 4, [0, 1, 2])
    sync.push(contribution(config, 2, 1, torch.zeros(_numel(config, 1)), round=6))
    assert _available(sync, 0, {0: 0, 1: 0}) == [RoundRequest(fragment=1, round=6, due_step=24)]
    assert _available(sync, 2, {0: 0, 1: 0}) == []  # the island that opened it sent already
    sync.push(contribution(config, 0, 1, torch.zeros(_numel(config, 1)), round=6))
    sync.poll()  # closes without island 1: no step times reported, so no grace slack
    assert [type(e) for e in _available(sync, 1, {0: 0, 1: 0})] == [VersionUpdate]  # its request was withdrawn


def test_a_late_joiner_starts_at_the_runs_step_never_ahead_of_it():
    config = run_config()
    sync, clock = _started(config, 2, liveness_timeout=5.0)
    clock.advance(4.0)
    sync.heartbeat(0, 500, 0.005, schedule_step=1200)  # 4 s at twice 200 steps a second: a reachable place
    sync.heartbeat(1, 700, 0.005, schedule_step=1190)
    assert sync.run.run_step() == 1190  # the lower median: a place both islands reached
    clock.advance(3.0)  # island 1 was killed: still live, but it must not drag the clock ahead
    sync.heartbeat(0, 530, 0.01, schedule_step=1230)
    assert sync.join(2, 1, SPECS).run_step == 1190
    sync.heartbeat(0, 531, 0.01, schedule_step=1000)  # a report older than one already made
    clock.advance(3.0)  # island 1 is gone: the two live islands are at 1230 and 1190 (the joiner)
    sync.heartbeat(2, 0, 0.01, schedule_step=1231)
    assert sync.run.run_step() == 1230


def test_a_send_for_a_round_the_run_has_passed_is_late_even_after_a_restart():
    config = run_config(min_quorum=1, gamma=0.0)  # H = 4, fragment 0 due at offset 2
    sync, clock = _started(config, 2)
    _place(sync, clock, 4 * 40 + 2, [0, 1])  # the run is at round 40 of fragment 0
    retried = sync.push(contribution(config, 1, 0, torch.zeros(_numel(config)), round=31))  # sent before a restart
    assert retried.late and sync.run.fragments[0].rounds.opened_at is None and sync.poll() == []
    sync.push(contribution(config, 0, 0, torch.zeros(_numel(config)), round=40))
    [closed] = sync.poll()
    assert (closed.round, closed.islands, closed.late) == (40, (0, 1), 1)


def test_a_restarted_synchronizer_knows_the_runs_step_from_its_rounds(tmp_path):
    config = run_config(min_quorum=1, gamma=0.0)  # H = 4, P = 2: fragment 0 due at offset 2
    sync, clock = _started(config, 1, checkpoint_dir=tmp_path, checkpoint_every=1)
    _place(sync, clock, 30 * 4 + 2, [0])
    sync.push(contribution(config, 0, 0, torch.zeros(_numel(config)), round=30))
    sync.poll()
    sync.shutdown()  # as the process's end does: the directory is the restarted one's
    restarted = Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, clock=FakeClock()))
    assert restarted.run.run_step() == 30 * 4 + 2
    assert restarted.status().rounds[0].round == 31


def test_an_old_or_unknown_base_is_merged_with_its_age_never_refused():
    """The merge needs a base's age, not its value: an island that was away (or that kept a
    version a restarted synchronizer lost) still adds what it did, discounted by how far behind."""
    config = run_config(min_quorum=1, gamma=0.0, history=2)
    sync, _ = _started(config, 1)
    for r in range(5):
        sync.push(contribution(config, 0, 0, torch.zeros(_numel(config)), round=r, base_version=r, seq=r))
        sync.poll()
    old = sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.01), round=5, base_version=0, seq=5))
    future = sync.push(contribution(config, 0, 1, torch.full((_numel(config, 1),), 0.01), round=5, base_version=40, seq=6))
    assert not old.late and not future.late
    assert [c.version for c in sync.poll()] == [6, 1]


def _raise(*args):
    raise RuntimeError("injected failure")


# parts of a closed round's bookkeeping: the object and the method that make each fail
FAILING_PARTS = {
    "influence guard's history": (lambda sync: sync.run.fragments[0].rounds.guard, "record"),
    "membership credit": (lambda sync: sync.membership, "credit"),
    "withdrawal of its requests": (lambda sync: sync.membership, "withdraw"),
    "checkpoint-due signal": (lambda sync: sync.checkpointer.due, "set"),
}


def _round_effects(sync):
    """What a closed round changed that an operator or an island sees."""
    status = sync.status()
    return {
        "outer steps": (sync.versions()[0], status.outer_steps),
        "round totals": (status.rounds[0].closed, status.rounds[0].merged_entries),
        "counters": status.accepted.get("merged", 0),
        "membership credit": status.islands[0].accepted,
        "withdrawal of its requests": [type(e) for e in _available(sync, 1, {0: 0, 1: 0})],
        "checkpoint-due signal": sync.checkpointer.due.is_set(),
    }


ALL_APPLIED = {"outer steps": (1, 1), "round totals": (1, 1), "counters": 1, "membership credit": 1,
               "withdrawal of its requests": [VersionUpdate], "checkpoint-due signal": True}


@pytest.mark.parametrize("failing", sorted(FAILING_PARTS))
def test_a_failure_in_a_closed_rounds_bookkeeping_skips_none_of_the_rest_and_the_fragment_steps_once(failing, monkeypatch,
                                                                                                    caplog):
    """A failure after the step skipped everything after it (counters, credit, the withdrawal of
    the other islands' requests, the checkpoint due), or left them to a closer's look again."""
    config = run_config(min_quorum=1, gamma=0.0)
    sync, clock = _started(config, 3, peer_votes=True)
    _place(sync, clock, 4, [0, 1])
    _place(sync, clock, 6, [2])  # with island 0's push, two of three reach round 1 (due at 6): the run's clock
    sync.push(contribution(config, 0, 0, torch.full((_numel(config),), 0.01), round=1, seq=1))  # island 1 is asked
    owner, method = FAILING_PARTS[failing]
    monkeypatch.setattr(owner(sync), method, _raise)
    [closed] = sync.poll()  # nothing raised: the round is closed
    assert (closed.round, closed.version, closed.islands) == (1, 1, (0,))
    assert sync.poll() == [] and not sync.run.fragments[0].rounds.entries  # looking again finds nothing to merge
    effects = _round_effects(sync)
    assert {k: v for k, v in effects.items() if k != failing} == {k: v for k, v in ALL_APPLIED.items() if k != failing}
    if failing in effects:  # the failed part stays short: it is not applied later, nor twice
        assert effects[failing] != ALL_APPLIED[failing]
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and f"its {failing} failed" in errors[0] and "round 1 closed into version 1" in errors[0]


def _clipped_round(fail):
    """Three honest rounds, then a round whose one entry is far too long (clipped); ``fail(frag)``
    makes the first try of its close fail. The fragment's published value and version once a
    look again has closed it."""
    config = run_config(num_fragments=1, min_quorum=1, gamma=0.0, downlink="bf16")
    sync, clock = _started(config, 2)
    numel = _numel(config)
    for v in range(3):
        _place(sync, clock, 4 * (v + 1), [0, 1])
        sync.push(contribution(config, 0, 0, torch.full((numel,), 0.01), round=v + 1, base_version=v, seq=v))
        sync.poll()
    _place(sync, clock, 16, [0, 1])
    sync.push(contribution(config, 1, 0, torch.full((numel,), 10.0), round=4, base_version=3, seq=0))
    if fail is not None:
        fail(sync.run.fragments[0].state)
        with pytest.raises(RuntimeError, match="injected"):
            sync.poll()
    [closed] = sync.poll()
    assert closed.clipped == 1
    return sync.versions()[0], sync.pull(0)[1]


def _fails_once(obj, name):
    original, failed = getattr(obj, name), []

    def failing(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise RuntimeError(f"injected failure in {name}")
        return original(*args, **kwargs)

    setattr(obj, name, failing)


def test_a_close_that_fails_before_its_step_merges_a_clipped_entry_clipped_once_when_tried_again():
    """The norm bound scaled an entry's outer gradient in place: a close tried again after a
    failure in the step merged it scaled twice, a smaller step than the same round closed once."""
    version, value = _clipped_round(None)
    retried_version, retried_value = _clipped_round(lambda frag: _fails_once(frag, "apply"))
    assert retried_version == version and torch.equal(retried_value, value)


def test_a_close_that_fails_inside_the_outer_step_steps_the_fragment_once_when_tried_again():
    """An error inside the step other than a non-finite one (here the lossy downlink's encoding)
    left the value and momentum stepped under the old version: the closer's next look stepped
    them again from the same contributions."""
    version, value = _clipped_round(None)
    retried_version, retried_value = _clipped_round(lambda frag: _fails_once(frag.published, "advance"))
    assert retried_version == version and torch.equal(retried_value, value)


def _next_round_opened_by_another_island(sync, config):
    """Island 1 sends for the fragment's next round, which opens and closes: the round's islands."""
    delta = torch.full((_numel(config),), 0.02)
    sync.clock.advance(1.0)  # time for island 1 to reach that round (a place advances at a bounded rate)
    sync.push(contribution(config, 1, 0, delta, round=sync.run.fragments[0].state.next_round, base_version=sync.versions()[0], seq=100))
    [closed] = sync.poll()
    return closed.islands


@pytest.mark.parametrize("failing", ["_settle", "bound_round"])
def test_a_failure_while_closing_never_lets_the_retry_of_a_merged_push_merge_again(failing):
    """Settling the round's sequence numbers was a part run after the step: when it failed (logged,
    the round closed), the retry of a push whose answer was lost found no record and was taken as
    new work, merged a second time in the next round (its islands (0, 1), not (1,)). A close that
    fails before its step is tried again; either way the contribution is merged once."""
    config = run_config(min_quorum=1, gamma=0.0)
    sync, _ = _started(config, 2, peer_votes=True)
    push = contribution(config, 0, 0, torch.full((_numel(config),), 0.01), seq=1)
    sync.push(push)
    _fails_once(sync.run.fragments[0].rounds if failing == "_settle" else sync.run.fragments[0].rounds.guard, failing)
    try:
        sync.poll()
    except RuntimeError:  # a close that fails before its step raises to its closer, which looks again
        pass
    sync.poll()
    assert sync.versions()[0] == 1 and sync.run.fragments[0].rounds.last.islands == (0,)
    retry = sync.push(push)  # the client's retry of a push whose answer it lost
    assert retry.duplicate and _next_round_opened_by_another_island(sync, config) == (1,)
    assert sync.status().rounds[0].merged_entries == 2


@pytest.mark.parametrize("closed_first", [True, False])
def test_a_push_retried_with_the_session_of_a_rejoin_is_a_retry_not_new_work(closed_first):
    """A client resends a push whose answer it lost with the session it holds at the retry: a new
    one when it rejoined meanwhile (its heartbeat noticed a restart). The retry of a merged
    contribution was taken as new work and merged a second time in the next round; the retry of a
    waiting one replaced it (counted as superseded). New work of the new session is still taken,
    whatever its sequence number (sequence numbers order one session's pushes)."""
    config = run_config(min_quorum=1, gamma=0.0)
    sync, _ = _started(config, 2, peer_votes=True)
    first = sync.join(0, 1, SPECS).session
    delta = torch.full((_numel(config),), 0.01)
    push = dataclasses.replace(contribution(config, 0, 0, delta, seq=7), session=first)
    sync.push(push)
    if closed_first:
        sync.poll()
    second = sync.join(0, 1, SPECS).session
    retry = sync.push(dataclasses.replace(push, session=second))
    sync.poll()
    assert retry.duplicate and sync.versions()[0] == 1 and sync.status().rounds[0].superseded == 0
    assert _next_round_opened_by_another_island(sync, config) == (1,)
    new_work = sync.push(dataclasses.replace(contribution(config, 0, 0, delta, round=2, base_version=2, seq=3), session=second))
    assert not new_work.duplicate and sync.poll()[0].islands == (0,)


def test_a_restart_keeps_the_influence_bounds_and_which_pushes_were_merged(tmp_path):
    """The influence guard's votes and the islands' settled contributions were not checkpointed: after
    a restart, one island alone in a round was bounded as in the run's first (by the fragment's
    own norm), and moved the model by 13.3x its norm where the same push before the restart moved it
    0.12x; and the retry of a push merged before the restart was merged a second time."""
    config = run_config(num_fragments=1, min_quorum=1, gamma=0.0)
    g = torch.Generator().manual_seed(0)

    def rounds_then_a_lone_push(restart: bool) -> tuple[float, bool]:
        directory = tmp_path / str(restart)
        sync, clock = _started(config, 2, checkpoint_dir=directory, checkpoint_every=1)
        g.manual_seed(0)
        for r in range(10):
            _place(sync, clock, 4 * r, [0, 1])
            version, value = sync.pull(0)
            pushes = [contribution(config, i, 0, 0.01 * torch.randn(value.numel(), generator=g), round=r,
                                   base_version=version, seq=r) for i in (0, 1)]
            for push in pushes:
                sync.push(push)
            sync.poll()
        if restart:
            sync.shutdown()  # as the process's end does: the directory is the restarted one's
            sync = Synchronizer(config, SynchronizerSettings(checkpoint_dir=directory, clock=clock))
        session = sync.join(0, 1, SPECS).session  # the island's client rejoined: a new session
        sync.join(1, 1, SPECS)
        _place(sync, clock, 40, [0, 1])
        version, before = sync.pull(0)
        lone = 10 * before.norm() * torch.randn(before.numel(), generator=g) / before.numel() ** 0.5
        sync.push(contribution(config, 1, 0, lone, round=10, base_version=version, seq=99))
        [closed] = sync.poll()
        assert closed.islands == (1,)
        moved = float((sync.pull(0)[1] - before).norm() / before.norm())
        return moved, sync.push(dataclasses.replace(pushes[0], session=session)).duplicate

    moved, retried = rounds_then_a_lone_push(restart=False)
    moved_after_restart, retried_after_restart = rounds_then_a_lone_push(restart=True)
    assert moved < 1.0 and moved_after_restart == pytest.approx(moved, rel=1e-6), (moved, moved_after_restart)
    assert retried and retried_after_restart
