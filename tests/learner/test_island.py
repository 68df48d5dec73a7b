"""IslandLearner mechanics against an in-process synchronizer: timing, apply modes, rounds, failures."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lightning_diloco.core.config import CodecConfig, MergeConfig, OuterConfig, RunConfig, ScheduleConfig
from lightning_diloco.core.fragments import build_layout, flatten_fragment
from lightning_diloco.learner.clock import SystemClock
from lightning_diloco.learner.inbox import Arrival
from lightning_diloco.learner.island import IslandLearner
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.helpers import SPECS, with_peer_votes
from tests.learner.service_link import ServiceLink

# a bound on waiting for an event that comes (a round closing, a version arriving): only a hang
# guard, far above what a loaded 2-core machine needs (10 s failed there, 2026-11-25)
WAIT_S = 120


def _config(P=2, H=4, tau=1, apply="overwrite", alpha=0.5, lr=1.0, momentum=0.0, quorum=1, keep=1.0):
    return RunConfig(
        schedule=ScheduleConfig(num_fragments=P, sync_every=H, overlap_steps=tau, apply=apply, mix_alpha=alpha, rebase_keep=keep),
        merge=MergeConfig(grace_gamma=0.0, min_quorum=quorum),
        outer=OuterConfig(lr=lr, momentum=momentum),
        codec=CodecConfig(uplink="fp32", downlink="fp32"),
    )


@pytest.fixture
def islands():
    """Makes islands on one in-process synchronizer (its closers running); closes everything after."""
    made, services = [], []

    def make(config, island=0, service=None, seed=0, **learner_settings):
        fresh = service is None
        if fresh:
            service = Synchronizer(config).start()
            services.append(service)
        g = torch.Generator().manual_seed(seed)
        params = [torch.randn(s.shape, generator=g) for s in SPECS]
        layout = build_layout(SPECS, config.schedule.num_fragments)
        link = ServiceLink(service)
        info = link.join(island, 1, SPECS)
        if fresh:  # a run past its first rounds (the join made them): a lone entry does not wait up
            with_peer_votes(service, range(4))  # to 10 s for a peer's; nothing here is about the first round
        learner = IslandLearner(params, layout, config, island=island, link=link, heartbeat_every=60, **learner_settings)
        made.append(learner)
        learner.start(run_step=info.run_step)
        return learner, link, params, service

    yield make
    for learner in made:
        learner.close()
    for service in services:
        service.shutdown()


def _settle(learner):
    """Wait until every fragment in flight has the version of its round (or its push failed)."""
    settled = learner.inbox.wait(lambda: all(learner.settled(p) for p in learner.in_flight), WAIT_S)
    flights = {p: (f.round, f.future.done() and (f.future.exception() or f.future.result()))
               for p, f in learner.in_flight.items()}
    assert settled, f"flights (round, ack) {flights}; versions received {learner.inbox.held()}, not yet taken " \
                    f"{ {p: (a.version, a.round) for p, a in learner.inbox.fresh.items()} }"


def _step(learner, params, delta=0.01, tokens=10.0):
    with torch.no_grad():
        for p in params:
            p.add_(delta)  # stands in for an inner optimizer step
    learner.after_step(tokens)


def test_a_fresh_island_seeds_and_starts_from_the_global_model(islands):
    config = _config()
    first, _, params0, service = islands(config, seed=0)
    second, _, params1, _ = islands(config, island=1, service=service, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))  # island 1 took island 0's seed


def test_reply_is_applied_exactly_tau_steps_after_the_send(islands):
    config = _config(P=2, H=4, tau=1)  # fragment 0 due at steps 2, 6; fragment 1 at 4, 8
    learner, link, params, service = islands(config)
    applied_at = {}
    for t in range(1, 9):
        before = learner.counters["applied"]
        _step(learner, params)
        _settle(learner)
        if learner.counters["applied"] > before:
            applied_at[t] = before
    assert sorted(applied_at) == [3, 5, 7]  # sends at 2, 4, 6 land at 3, 5, 7; the one at 8 is in flight
    assert learner.versions == [2, 1] and 1 in learner.in_flight
    assert [f.sent_round for f in learner.fragments] == [1, 2]  # rounds are schedule step // H


def test_overwrite_with_plain_averaging_keeps_a_single_island_on_its_own_trajectory(islands):
    config = _config(P=1, H=2, tau=0)
    learner, link, params, _ = islands(config)
    expected = [p.clone() for p in params]
    for _ in range(6):
        _step(learner, params)
        for e in expected:
            e.add_(0.01)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params, expected))
    assert learner.versions == [3]


def test_mix_blends_local_and_global(islands):
    config = _config(P=1, H=2, tau=1, apply="mix", alpha=0.25, lr=0.5)
    learner, link, params, service = islands(config)
    _step(learner, params)
    _step(learner, params)  # sent after step 2
    _settle(learner)
    sent = flatten_fragment([p for p in params])
    _step(learner, params)  # applied after step 3
    global_value = service.pull(0)[1]
    local = sent + 0.01  # local moved on by one more step after the snapshot
    assert torch.allclose(flatten_fragment(params), 0.25 * local + 0.75 * global_value, atol=1e-6)


@pytest.mark.parametrize("keep", [1.0, 0.25, 0.0])
def test_rebase_keeps_its_share_of_the_progress_made_since_the_snapshot(islands, keep):
    config = _config(P=1, H=4, tau=2, apply="rebase", lr=0.5, keep=keep)
    learner, link, params, service = islands(config)
    for _ in range(4):
        _step(learner, params)  # sent after step 4
    _settle(learner)
    for _ in range(2):
        _step(learner, params)  # applied after step 6
    global_value = service.pull(0)[1]
    assert torch.allclose(flatten_fragment(params), global_value + keep * 0.02, atol=1e-6)
    assert learner.fragments[0].steps == 2  # the two steps since the snapshot still count


def test_a_fragment_in_flight_is_skipped_not_sent_twice(islands):
    config = _config(P=1, H=2, tau=1)
    learner, link, params, _ = islands(config)
    link.gate = threading.Event()  # the synchronizer holds every push
    for _ in range(6):
        _step(learner, params)
    assert learner.counters["sent"] == 1 and learner.counters["skipped"] == 2
    link.gate.set()


def test_training_goes_on_while_the_synchronizer_is_down_and_resyncs_after(islands):
    config = _config(P=1, H=2, tau=1)
    learner, link, params, service = islands(config)
    link.down = True
    for _ in range(6):
        _step(learner, params)
        _settle(learner)
    assert learner.counters["failed"] >= 2 and learner.counters["applied"] == 0
    assert learner.versions == [0] and learner.fragments[0].steps == 6  # counters keep accumulating
    link.down = False
    # the island trains on as it would (tau 1 never waits): its place on the run's clock catches
    # up at the rate the synchronizer allows (membership.py), so its first sends after the outage
    # may be admitted for a round that already closed and wait as late until a round opens. (This
    # test used to wait for each flight to settle after every step, and hung on such a late one
    # for its 120 s bound when it ran after a test that left the clock's step rate slow.)
    for _ in range(200):
        _step(learner, params)
        if learner.counters["applied"] >= 1:
            break
        learner.inbox.wait(lambda: all(learner.settled(p) for p in learner.in_flight), 0.05)
    assert learner.counters["applied"] >= 1 and learner.versions[0] >= 1 and learner.reachable


def test_an_island_asked_for_a_round_sends_at_its_next_step_in_phase_with_the_run(islands):
    config = _config(P=1, H=4, tau=1, quorum=2)
    first, _, params0, service = islands(config)
    second, _, params1, _ = islands(config, island=1, service=service, seed=1)
    # a third island has reached step 4 too: with island 0's send, two of three islands are at
    # round 1, so it is due on the run's clock (a request goes out only then)
    service.join(2, 1, SPECS)
    service.heartbeat(2, 4, 0.1, schedule_step=4)
    for _ in range(4):
        _step(first, params0)  # island 0 sends for round 1 at step 4; island 1 has not moved
    assert second.inbox.wait(lambda: 0 in second.inbox.requests, WAIT_S)  # the round is due: island 1 is asked
    _step(second, params1)
    assert second.counters["requested"] == 1 and [f.sent_round for f in second.fragments] == [1]  # it sent for round 1 ...
    assert second.schedule_step == 4 and second.counters["realigned"] == 1  # ... and jumped to the run's step
    _settle(first), _settle(second)
    assert service.status().rounds[0].last.contributors == 2  # both in the same round


def test_a_send_merged_into_an_earlier_open_round_ends_its_flight_with_that_round(islands):
    """An island ahead of the run joins the round that is open; waiting for the round it sent for
    would keep the fragment in flight for good (and stall a quorum of every island)."""
    config = _config(P=1, H=4, tau=1, quorum=2)
    first, _, params0, service = islands(config)
    second, _, params1, _ = islands(config, island=1, service=service, seed=1)
    for _ in range(4):
        _step(first, params0)  # round 1 opens, waiting for a quorum of 2
    second.schedule_step = 7
    _step(second, params1)  # sent for round 2, merged into round 1
    assert second.in_flight[0].round == 2
    _settle(first), _settle(second)
    _step(second, params1)
    assert second.in_flight == {} and second.counters["applied"] == 1 and second.versions == [1]


def test_a_version_that_comes_before_its_sends_ack_waits_for_the_ack_and_ends_the_flight(islands):
    """K = 1 closes the round as the push arrives: its version can reach the island before the
    push's ack. Taken at its apply step without the ack, it could not end the flight, which then
    waited for the next round's version (skipping that send; a test hung on it under load)."""
    learner, link, params, _ = islands(_config(P=1, H=2, tau=1))
    ack_back, push = threading.Event(), link.push

    def push_answered_late(contribution):
        ack = push(contribution)
        ack_back.wait(WAIT_S)
        return ack

    link.push = push_answered_late
    try:
        for _ in range(2):
            _step(learner, params)  # sends for round 1 at step 2
        assert learner.inbox.wait(lambda: learner.inbox.received[0] == 1, WAIT_S)  # its version is here, its ack is not
        _step(learner, params)  # step 3, the send's apply step: the version waits for the ack
        assert learner.counters["received"] == learner.counters["applied"] == 0 and 0 in learner.in_flight
    finally:
        ack_back.set()
    _settle(learner)
    _step(learner, params)
    assert learner.counters["applied"] == 1 and learner.counters["received"] == 0 and not learner.in_flight
    assert learner.versions == [1]


def test_a_non_contributor_takes_each_new_version_at_its_next_step(islands):
    config = _config(P=1, H=4, tau=1)
    first, _, params0, service = islands(config)
    second, _, params1, _ = islands(config, island=1, service=service, seed=1)
    for _ in range(4):
        _step(first, params0)
    _settle(first)
    assert second.inbox.wait(lambda: 0 in second.inbox.fresh, WAIT_S)  # the version reached island 1
    _step(second, params1)
    assert second.counters["received"] == 1 and second.versions == [1]
    assert torch.allclose(flatten_fragment(params1), service.pull(0)[1])


def test_a_version_arriving_between_decision_and_apply_is_applied_next_not_in_place_of_the_decided_one(islands):
    """The reader threads may store a newer version after the leader took one: the step applies
    the version it decided on, under that version's number, and the newer one at the next step."""
    config = _config(P=1, H=4, tau=1)
    first, _, params0, service = islands(config)
    second, _, params1, _ = islands(config, island=1, service=service, seed=1)
    for _ in range(4):
        _step(first, params0)
    _settle(first)
    assert second.inbox.wait(lambda: 0 in second.inbox.fresh, WAIT_S)
    decided = second.inbox.fresh[0]  # a delta from the version island 1 holds (or whole)
    decided_value = decided.steps[0] if decided.base_version < 0 else second.fragments[0].base + decided.steps[0]
    newer = Arrival(fragment=0, version=decided.version + 1, round=decided.round + 1, steps=(torch.ones_like(decided.steps[0]),),
                    base_version=decided.version, included=False)
    take = second.inbox.take

    def take_then_newer_arrives(ready):
        out = take(ready)
        if out:
            second.inbox.put(newer)  # lands while the training thread is between plan and apply
        return out

    second.inbox.take = take_then_newer_arrives
    _step(second, params1)
    assert second.versions == [decided.version]
    assert torch.equal(flatten_fragment(params1), decided_value)  # not the newer value under the older number
    second.inbox.take = take
    _step(second, params1)
    assert second.versions == [newer.version] and torch.equal(flatten_fragment(params1), decided_value + 1.0)
    # two applies (whether the second ends a send that island 1 made meanwhile, asked for the round, or not)
    assert second.counters["received"] + second.counters["applied"] == 2


def test_a_late_joiner_starts_in_phase_with_the_run(islands):
    config = _config(P=2, H=4, tau=1)
    first, _, params0, service = islands(config)
    for _ in range(10):
        _step(first, params0)
        _settle(first)
    late, _, _, _ = islands(config, island=1, service=service, seed=3)
    assert late.schedule_step >= 8 and late.step == 0  # at the run's step, not at its own 0
    assert late.versions == first.versions or late.versions == [v for v in service.versions().values()]


def test_finish_keeps_the_local_weights_when_none_of_its_work_was_merged(islands):
    config = _config(P=1, H=8, tau=1)
    learner, _, params, _ = islands(config)
    for _ in range(3):
        _step(learner, params)  # shorter than the schedule: nothing was ever sent
    local = flatten_fragment(params)
    assert learner.finish(timeout=1) is False
    assert torch.equal(flatten_fragment(params), local)


def test_finish_loads_the_global_model_once_its_work_is_in(islands):
    config = _config(P=1, H=2, tau=1)
    learner, _, params, service = islands(config)
    for _ in range(3):
        _step(learner, params)
    assert service.status().islands[0].steps == 0  # heartbeats every 60 s here: none since the join
    assert learner.finish(timeout=WAIT_S) is True
    assert torch.equal(flatten_fragment(params), service.pull(0)[1])
    assert service.status().islands[0].steps == 3  # the end says the steps as trained (the run's report reads them)


def test_finish_does_not_wait_for_a_late_contribution_whose_round_may_never_open(islands):
    """At the end of a run nobody may send for the next round: waiting would only cost the timeout."""
    config = _config(P=1, H=2, tau=1)
    first, _, params0, service = islands(config)
    second, _, params1, _ = islands(config, island=1, service=service, seed=1)
    for _ in range(3):
        _step(first, params0)  # island 0 sends for round 0 at its step 2; K = 1 closes it
    _settle(first)
    for _ in range(2):
        _step(second, params1)  # island 1's send for round 0 comes after it closed
    assert second.in_flight[0].future.result(timeout=WAIT_S).late
    waits = []
    wait = second.inbox.wait

    def recorded(predicate, timeout):
        waits.append(predicate())  # what finish() waits for is settled already
        return wait(predicate, 0)

    second.inbox.wait = recorded
    second.merged_any = True  # its work counts as merged: the global model is pulled
    assert second.finish(timeout=30) is True
    assert waits == [True]


def test_finish_stops_waiting_once_a_send_is_acked_late_and_counts_it_unmerged(islands):
    """The ack that says a send is late may come only during the end's wait (pushes queue under
    load): its round opens only on the next send, which nobody makes at the end, so the wait
    must end then, not after its timeout, and the contribution is counted as not merged."""
    import threading

    config = _config(P=1, H=2, tau=1)
    first, _, params0, service = islands(config)
    second, link1, params1, _ = islands(config, island=1, service=service, seed=1)
    for _ in range(3):
        _step(first, params0)  # island 0 sends for round 0 at its step 2; K = 1 closes it
    _settle(first)
    link1.gate = threading.Event()  # island 1's push waits: its ack is not back when finish starts
    for _ in range(2):
        _step(second, params1)  # its send for round 0 comes after round 0 closed: late
    settled = []
    wait = second.inbox.wait

    def recorded(predicate, timeout):
        threading.Timer(0.2, link1.gate.set).start()  # the ack comes back during the wait
        settled.append(wait(predicate, timeout))
        return settled[-1]

    second.inbox.wait = recorded
    second.merged_any = True  # its work counts as merged: the global model is pulled
    assert second.finish(timeout=60) is True
    assert settled == [True]  # the wait ended on the late ack, not on its 60 s timeout
    assert second.counters["unmerged"] == 1 and second.metrics()["diloco/syncs_unmerged"] == 1.0


def test_the_ends_wait_is_a_few_step_times(islands):
    config = _config(tau=2)
    learner, _, _, service = islands(config, step_time=0.5)
    assert learner.final_wait() == 4 * 3 * 0.5
    tiny, _, _, _ = islands(config, island=1, service=service, step_time=0.001)  # at least a few seconds for the network
    assert tiny.final_wait() == 3.0


class SteppedClock(SystemClock):
    """The machine's waits and heartbeat thread, with a time that moves only when the test moves it."""

    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


class CountingPool(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_an_island_times_its_steps_on_its_clock_and_pushes_on_its_executor(islands):
    clock, pool = SteppedClock(), CountingPool()
    learner, _, params, _ = islands(_config(tau=2), clock=clock, executor=pool)
    for _ in range(5):
        clock.t += 0.5  # each inner step takes half a second on the island's clock
        _step(learner, params)
    assert learner.final_wait() == pytest.approx(4 * 3 * 0.5)  # what the end waits: a few of the steps measured
    assert pool.submitted == learner.counters["sent"] == 2
    learner.close()
    with pytest.raises(RuntimeError, match="shutdown"):  # the island's executor ends with it
        pool.submit(print)


def _round_open(service, fragment):
    """Wait until ``fragment``'s round is open (a send reached it)."""
    deadline = time.monotonic() + WAIT_S
    while not service.status().rounds[fragment].open:
        assert time.monotonic() < deadline, "the send never reached its round"
        time.sleep(0.01)


def test_a_stop_ends_a_synchronous_islands_wait_for_its_round_at_once(islands):
    """tau = 0 waits for each round it sent for, up to push_wait; K = 2 with one island never
    closes it. A stop (SIGTERM) ends that wait and every later one: the process ends within a
    step, not a push wait (the launcher's SIGTERM took 35 s)."""
    config = _config(P=2, H=4, tau=0, quorum=2)  # fragment 0 due at step 2, fragment 1 at step 4
    learner, _, params, service = islands(config)
    learner.push_wait = 10 * WAIT_S  # the wait below must end by the stop, never by this
    stepped = threading.Thread(target=lambda: [_step(learner, params) for _ in range(4)], name="diloco-test-steps")
    stepped.start()
    _round_open(service, 0)
    learner.stop()
    stepped.join(timeout=WAIT_S)
    assert not stepped.is_alive(), "the stop did not end the wait for the round"
    assert learner.step == 4 and learner.counters["sent"] == 2 and learner.counters["applied"] == 0


def test_an_island_closed_leaves_the_run_and_the_others_rounds_no_longer_wait_for_it(islands):
    """K = M = 2, synchronous: once island 1 ended its run (closed, after its end), island 0's rounds
    close with it alone at once, where they waited out its push wait at every due fragment."""
    config = _config(P=2, H=4, tau=0, quorum=2)
    service = Synchronizer(config, SynchronizerSettings(num_islands=2)).start()
    try:
        first, _, params0, _ = islands(config, service=service)
        second, _, _, _ = islands(config, island=1, service=service, seed=1)
        second.close()
        status = service.status()
        assert status.islands[1].left and status.live_islands == [0]
        first.push_wait = WAIT_S  # a hang guard: waited out, the send would count as failed
        for _ in range(4):
            _step(first, params0)
        assert first.counters["applied"] == 2 and first.counters["failed"] == 0
    finally:
        first.close()
        service.shutdown()


def test_an_island_that_cannot_leave_says_so_and_closes_anyway(islands, caplog):
    learner, link, _, service = islands(_config())
    link.down = True  # the synchronizer is gone
    learner.close()
    assert "could not tell the synchronizer that it leaves the run" in caplog.text
    assert service.status().live_islands == [0]  # waited for until its liveness timeout, as before


def test_state_dict_round_trips_and_refuses_another_model(islands):
    config = _config()
    learner, _, params, _ = islands(config)
    for _ in range(3):
        _step(learner, params)
    state = learner.state_dict()
    assert state["step"] == 3 and state["schedule_step"] == 3 and len(state["bases"]) == 2
    learner.load_state_dict(state)
    with pytest.raises(ValueError, match="does not match this model"):
        learner.load_state_dict({**state, "layout_hash": "x"})


def test_sync_threads_run_torch_single_threaded_and_leave_the_training_thread_alone(islands, two_torch_threads):
    learner, *_ = islands(_config())
    assert learner.leader.executor.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == 2


def test_synchronous_diloco_applies_a_fragment_once_when_a_version_came_before_its_send(islands):
    """tau = 0: another island's version of the fragment reached this island just before it sends
    the fragment. The earlier version used to be taken as an apply of its own beside the awaited
    one, and the second apply of the fragment in the step raised KeyError (the main job's islands
    crashed and restarted, 2026-11-27). Its send comes late (round 0 closed with the other island
    alone): the island does not wait for it, and applies the round that merges it, once."""
    config = _config(P=1, H=4, tau=0)
    first, _, params0, service = islands(config)
    second, _, params1, _ = islands(config, island=1, service=service, seed=1)
    for _ in range(3):
        _step(second, params1)
    for _ in range(4):
        _step(first, params0)  # sends and closes round 0 alone (quorum 1)
    assert second.inbox.wait(lambda: 0 in second.inbox.fresh, WAIT_S)
    _step(second, params1)  # due: sends late for round 0 and goes on (no KeyError, no 120 s wait)
    assert 0 in second.in_flight and second.in_flight[0].late() and second.counters["applied"] == 0
    for _ in range(40):  # the first island's next round takes the late entry in
        for _ in range(4):
            _step(first, params0)
        if second.inbox.wait(lambda: second.settled(0), 1):
            break
    _step(second, params1)
    assert second.counters["applied"] == 1 and second.versions == [service.status().versions[0]] and second.versions[0] >= 2


def test_only_a_synchronous_island_counts_time_waiting_on_the_network(islands):
    """The recipes report the training loops' wait on the network apart from the sync hook's own
    work: an island that overlaps (tau >= 1) never waits for a round, one at tau = 0 waits for each
    of its sends' rounds, and that wait is part of its time in the hook."""
    waits = {}
    for tau in (0, 1):
        learner, _, params, _ = islands(_config(P=1, H=2, tau=tau))
        for _ in range(8):
            _step(learner, params)
        m = learner.metrics()
        waits[tau] = m["diloco/network_wait_s"]
        assert 0 <= m["diloco/network_wait_s"] <= m["diloco/blocked_s"], m
    assert waits[1] == 0.0 and waits[0] > 0.0, waits


def test_an_island_resumed_with_a_copy_off_the_published_value_pulls_it_whole_and_keeps_its_progress(islands):
    """A checkpoint saved after summed steps (IslandFragment.exact False) holds a copy a restarted
    synchronizer refuses; the resumed island, at the same version, pulls the fragment whole when it
    starts, and its next step takes it as its base, keeping the local progress it resumed with."""
    config = _config()
    learner, _, params, service = islands(config)
    _step(learner, params)
    state = learner.state_dict()
    state["bases"][1] = state["bases"][1] + 1e-3  # what summed steps rounded to
    state["exact"] = [True, False]
    link = ServiceLink(service)
    link.join(1, 1, SPECS)
    resumed = IslandLearner([p.detach().clone() for p in params], build_layout(SPECS, 2), config, island=1, link=link,
                            heartbeat_every=60)
    try:
        resumed.start(resume=state)
        f = resumed.fragments[1]
        version, published = service.pull(1)
        assert f.version == version and not f.exact and f.held() is None
        local = resumed.shards.read(1)
        assert resumed.inbox.wait(lambda: 1 in resumed.inbox.fresh, WAIT_S)  # the pull's answer, whole
        resumed.after_step(10.0)
        assert f.version == version and torch.equal(f.base, published) and f.held() == (version, f.base)
        assert torch.allclose(resumed.shards.read(1), local - 1e-3)  # its progress kept, moved by the base's error
    finally:
        resumed.close()
