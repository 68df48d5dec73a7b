"""The synchronizer in-process: validation, refusals, idempotency, checkpoints, the closer threads."""

import logging
import threading
import time
from dataclasses import replace

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.fragments import TensorSpec, split_fragment
from lightning_diloco.core.merge import contribution_weight, merge_outer_gradients
from lightning_diloco.synchronizer.closers import CLOSER_TICK, IDLE_WAIT, retry_wait
from lightning_diloco.synchronizer.requests import Refusal
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.helpers import SPECS, FakeClock, contribution, initial_fragments, layout, run_config, wait_for_version, with_peer_votes


def _started(config, islands, **kwargs):
    kwargs.setdefault("clock", FakeClock())
    sync = Synchronizer(config, SynchronizerSettings(**kwargs))
    for i in range(islands):
        sync.join(i, 1, SPECS)
    for p, value in initial_fragments(config).items():
        sync.seed(0, p, get_codec("fp32").encode(value))
    return sync


def test_first_seed_wins_and_versions_start_at_zero():
    config = run_config()
    sync = _started(config, 1)
    assert sync.versions() == {0: 0, 1: 0}
    other = torch.zeros(layout(config).fragment_numel(0))
    assert sync.seed(0, 0, get_codec("fp32").encode(other)) is False
    assert torch.equal(sync.pull(0)[1], initial_fragments(config)[0])


def test_single_island_round_is_one_outer_step_of_its_own_delta():
    config = run_config()
    sync = _started(config, 1)
    base = initial_fragments(config)[0]
    delta = torch.full_like(base, 0.01)
    ack = sync.push(contribution(config, 0, 0, delta))
    assert (ack.round, ack.late, ack.duplicate, ack.version) == (0, False, False, 0)
    [closed] = sync.poll()
    assert closed.version == 1 and closed.islands == (0,)
    # outer gradient -delta, Nesterov first step: theta -= lr * (g + mu * g) = lr * (1 + mu) * delta
    assert torch.allclose(sync.pull(0)[1], base + 0.7 * 1.9 * delta, atol=1e-6)


def test_merge_weights_contributions_by_tokens_squared_over_steps():
    config = run_config(min_quorum=2, num_fragments=1)
    sync = _started(config, 2)
    numel = layout(config).fragment_numel(0)
    g = torch.Generator().manual_seed(3)
    deltas = [torch.randn(numel, generator=g) * 0.01 for _ in range(2)]
    for i in range(2):
        sync.push(contribution(config, i, 0, deltas[i], tokens=100.0 + 30 * i, steps=4 + i))  # within the 1.4x weight cap
    sync.poll()
    specs = layout(config).fragment_specs(0)
    weights = [contribution_weight(100.0, 4), contribution_weight(130.0, 5)]
    merged = merge_outer_gradients([split_fragment(-d, specs) for d in deltas], weights, [s.role for s in specs], "rda")
    outer = torch.cat([m.reshape(-1) for m in merged])
    expected = initial_fragments(config)[0] - 0.7 * 1.9 * outer
    assert torch.allclose(sync.pull(0)[1], expected, atol=1e-5)


def test_repeated_push_is_answered_idempotently_never_merged_twice():
    config = run_config(min_quorum=2)
    sync = _started(config, 2)
    c = contribution(config, 0, 0, torch.full((layout(config).fragment_numel(0),), 0.01))
    first, waiting = sync.push(c), sync.push(c)
    assert waiting.duplicate and waiting.round == first.round
    sync.push(contribution(config, 1, 0, torch.zeros(layout(config).fragment_numel(0))))
    sync.poll()
    again = sync.push(c)  # a retry after the merge: same answer, nothing added
    assert again.duplicate and again.round == 0 and sync.versions()[0] == 1
    assert sync.status().accepted == {"on_time": 2, "duplicate": 2, "merged": 2}


def test_an_older_sequence_number_than_one_merged_is_refused():
    config = run_config()
    sync = _started(config, 1)
    numel = layout(config).fragment_numel(0)
    sync.push(contribution(config, 0, 0, torch.zeros(numel), seq=5))
    sync.poll()
    with pytest.raises(Refusal) as err:
        sync.push(contribution(config, 0, 0, torch.zeros(numel), seq=4, round=1, base_version=1))
    assert err.value.reason == "old_sequence" and sync.versions()[0] == 1


def test_closer_threads_close_rounds_with_nobody_waiting_and_stop_on_shutdown():
    config = run_config(min_quorum=1)
    sync = _started(config, 1, clock=time.monotonic).start()
    try:
        sync.push(contribution(config, 0, 1, torch.zeros(layout(config).fragment_numel(1))))
        assert wait_for_version(sync.pull, 1, 1)[0] == 1
    finally:
        sync.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("diloco-closer")]


def test_a_closer_whose_close_failed_logs_it_and_closes_the_round_on_its_next_look(caplog):
    config = run_config(min_quorum=1)
    sync = _started(config, 1, clock=time.monotonic)
    rounds, real_close, calls = sync.run.fragments[1].rounds, sync.run.fragments[1].rounds.close, []

    def close_failing_once(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real_close(*args, **kwargs)

    rounds.close = close_failing_once
    sync.start()
    try:
        sync.push(contribution(config, 0, 1, torch.zeros(layout(config).fragment_numel(1))))
        assert wait_for_version(sync.pull, 1, 1)[0] == 1
    finally:
        sync.shutdown()
    assert len(calls) == 2 and "closing its round failed" in caplog.text


def _bad_input(config, reason):
    numel = layout(config).fragment_numel(0)
    good = torch.full((numel,), 0.01)
    nan = good.clone()
    nan[3] = float("nan")
    builders = {
        "layout_mismatch": lambda: contribution(config, 0, 0, good, layout_hash="0" * 16),
        "unknown_fragment": lambda: contribution(config, 0, 7, good),
        "bad_payload": lambda: contribution(config, 0, 0, torch.zeros(numel + 1)),
        "non_finite": lambda: replace(contribution(config, 0, 0, good), payload=nan.numpy().tobytes()),
        "bad_counters": lambda: contribution(config, 0, 0, good, steps=0),
        "unknown_codec": lambda: replace(contribution(config, 0, 0, good), codec="int3"),
        "not_joined": lambda: contribution(config, 5, 0, good),
        "bad_sequence": lambda: contribution(config, 0, 0, good, base_version=-1),
    }
    return builders[reason]()


@pytest.mark.parametrize("reason", ["layout_mismatch", "unknown_fragment", "bad_payload", "non_finite", "bad_counters",
                                    "unknown_codec", "not_joined", "bad_sequence"])
def test_bad_input_is_refused_with_its_reason_and_the_state_is_unchanged(reason):
    config = run_config()
    sync = _started(config, 1)
    before = {p: sync.pull(p)[1] for p in range(2)}
    with pytest.raises(Refusal) as err:
        sync.push(_bad_input(config, reason))
    sync.poll()
    assert err.value.reason == reason and str(err.value)
    assert sync.status().refused == {reason: 1}
    assert sync.versions() == {0: 0, 1: 0}
    assert all(torch.equal(sync.pull(p)[1], before[p]) for p in range(2))
    assert sync.status().rounds[0].open_contributors == 0


def test_a_model_with_another_layout_cannot_join():
    sync = _started(run_config(), 1)
    other = [*SPECS[:-1], TensorSpec(name="head.weight", shape=(5, 8), dtype="float32", role="dense")]
    with pytest.raises(Refusal, match="head.weight") as err:
        sync.join(1, 1, other)
    assert err.value.reason == "layout_mismatch"


def test_a_subscription_before_joining_is_refused_at_once():
    sync = _started(run_config(), 1)
    with pytest.raises(Refusal) as err:
        sync.subscribe(3, {})
    assert err.value.reason == "not_joined"


def test_a_huge_outer_gradient_is_bounded_and_the_state_stays_finite():
    config = run_config(num_fragments=1)
    sync = _started(config, 2)
    numel = layout(config).fragment_numel(0)
    for v in range(3):
        sync.clock.advance(1.0)  # the time to reach each round (a place advances at a bounded rate)
        sync.push(contribution(config, 0, 0, torch.full((numel,), 0.01), round=v, base_version=v, seq=v))
        sync.poll()
    before = sync.pull(0)[1]
    sync.clock.advance(1.0)
    sync.push(contribution(config, 1, 0, torch.full((numel,), 1e30), round=3, base_version=3, seq=0))
    [closed] = sync.poll()
    after = sync.pull(0)[1]
    assert closed.clipped == 1 and torch.isfinite(after).all()
    step = float((after - before).norm())
    assert step < 10 * 1.9 * 0.7 * 2 * float(torch.full((numel,), 0.01).norm())  # z x the honest norm, through Nesterov


def test_a_step_that_would_not_be_finite_leaves_its_contributor_out():
    config = run_config(num_fragments=1, outlier_z=0.0)  # no norm bound: only the finite check stands
    sync = _started(config, 2)
    numel = layout(config).fragment_numel(0)
    sync.push(contribution(config, 0, 0, torch.full((numel,), 0.01), seq=0, tokens=1.0, steps=1))
    sync.push(contribution(config, 1, 0, torch.full((numel,), 3e38), seq=0))  # finite, and weighs most
    [closed] = sync.poll()
    assert closed.islands == (0,) and closed.dropped == 1 and torch.isfinite(sync.pull(0)[1]).all()
    assert sync.status().refused == {"non_finite_step": 1}


def test_restart_from_checkpoint_keeps_versions_fragments_momentum_and_rounds(tmp_path, caplog):
    config = run_config()
    sync = _started(config, 1, checkpoint_dir=tmp_path, checkpoint_every=1)
    numel = layout(config).fragment_numel(1)
    for v in range(3):
        sync.push(contribution(config, 0, 1, torch.full((numel,), 0.01 * (v + 1)), round=v + 1, base_version=v, seq=v))
        sync.poll()
    sync.shutdown()  # as the process's end does: the directory is the restarted one's
    with caplog.at_level(logging.INFO):
        restarted = Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, clock=FakeClock()))
    assert restarted.versions() == {0: 0, 1: 3}
    # a rerun of a documented command with the same folder continues the old run: it is said
    assert f"from {tmp_path} after 3 outer steps" in caplog.text and "a new run needs a new --checkpoint-dir" in caplog.text
    for p in range(2):
        a, b = sync.run.state.fragments[p], restarted.run.state.fragments[p]
        assert torch.equal(a.value, b.value) and a.next_round == b.next_round
        assert (a.outer.momentum_buffer is None and b.outer.momentum_buffer is None) or torch.equal(a.outer.momentum_buffer, b.outer.momentum_buffer)
    # islands carry on against the restarted synchronizer
    for f in sync.run.state.fragments.values():  # the old one, a reference now, logs nothing into the new one's directory
        f.publish_hook = None
    restarted.join(0, 1, SPECS)
    for s in (restarted, sync):
        ack = s.push(contribution(config, 0, 1, torch.full((numel,), 0.01), round=4, base_version=3, seq=3))
        assert (ack.round, ack.late) == (4, False)
        s.poll()
    assert torch.equal(restarted.pull(1)[1], sync.pull(1)[1]) and restarted.versions()[1] == 4


def test_a_standalone_synchronizer_fits_its_fragments_to_the_first_islands_model():
    """24 fragments asked for, a 4-tensor model: refusing every island (5 restarts each, then
    'goodput 0%') helped nobody; the run takes one fragment per tensor and says so."""
    from lightning_diloco.core.config import ScheduleConfig

    config = replace(run_config(), schedule=ScheduleConfig(num_fragments=24, sync_every=24, overlap_steps=1))
    sync = Synchronizer(config, SynchronizerSettings(clock=FakeClock()))
    reply = sync.join(0, 1, SPECS)
    assert reply.config.schedule.num_fragments == 4 == len(sync.run.fragments)
    said = sync.status().adjustments[0]
    assert "num_fragments lowered from 24 to 4" in said
    assert "num_fragments=" in said and "--num-fragments" in said  # an embedded run has no flags: both spellings
    with pytest.raises(Refusal, match="model's 3 trainable tensors"):
        sync.join(1, 1, SPECS[:3])  # a later island with another model is still refused


def test_a_restarted_synchronizer_keeps_the_fragment_count_it_lowered_and_warns_only_of_settings_given_otherwise(
        tmp_path, caplog):
    """`lightning-diloco run --resume` restarts it with the settings it was first given: its own
    lowering is the run's, taken again without a word of settings that "differ"; a setting given
    otherwise is named."""
    from lightning_diloco.core.config import ScheduleConfig

    config = replace(run_config(), schedule=ScheduleConfig(num_fragments=24, sync_every=24, overlap_steps=1))
    sync = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path))
    sync.join(0, 1, SPECS)
    sync.checkpoint()
    sync.shutdown()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_diloco.synchronizer.service"):
        restarted = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path))
    assert restarted.run.config.schedule.num_fragments == 4 and "differ" not in caplog.text
    assert restarted.join(0, 1, SPECS).config.schedule.num_fragments == 4
    assert "num_fragments lowered from 24 to 4" in restarted.status().adjustments[0]
    restarted.shutdown()
    other = replace(config, schedule=replace(config.schedule, sync_every=32))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_diloco.synchronizer.service"):
        Synchronizer(other, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path)).shutdown()
    assert "sync_every=24 (given: 32)" in caplog.text and "num_fragments" not in caplog.text


def test_a_closer_that_keeps_failing_backs_off_to_its_idle_wait_and_never_overflows():
    waits = [retry_wait(n) for n in range(8)]
    assert waits[0] == CLOSER_TICK and waits == sorted(waits) and waits[-1] == IDLE_WAIT
    assert retry_wait(10**6) == IDLE_WAIT  # a closer failing for weeks still computes its wait


def test_a_closer_that_keeps_failing_backs_off_however_many_pushes_notify_it():
    """Each push notifies its fragment's condition, which woke a failing closer at once: it looked
    again, failed and logged a traceback per push (200 in 1.1 s of pushes), whatever its back-off.
    Its looks are now no more than its back-off waits allow in the time the pushes took."""
    config = run_config(num_fragments=1, min_quorum=1)
    sync = _started(config, 3, clock=time.monotonic)
    with_peer_votes(sync, range(3))  # island 0's entry alone in its round does not wait for a peer's
    looks, failed = [], threading.Event()

    def failing_apply(outer_gradient, share=1.0, bound=None):
        looks.append(time.monotonic())
        failed.set()
        raise RuntimeError("injected failure that persists")

    sync.run.fragments[0].state.apply = failing_apply
    numel = layout(config).fragment_numel(0)
    sync.start()
    try:
        sync.push(contribution(config, 0, 0, torch.full((numel,), 0.01), seq=1))
        assert failed.wait(60), "the closer never tried to close the round"
        for k in range(2, 60):  # during its back-off, each a notification
            sync.push(contribution(config, k % 3, 0, torch.full((numel,), 0.01), seq=k))
        until = time.monotonic()
    finally:
        sync.shutdown()
    # the looks that the back-off lets happen by `until`, whatever the machine's load made it
    allowed, waited = 1, retry_wait(0)
    while looks[0] + waited <= until:
        allowed += 1
        waited += retry_wait(allowed - 1)
    assert len([t for t in looks if t <= until]) <= allowed


def test_an_island_started_with_another_num_islands_is_refused_naming_both_also_after_a_restart(tmp_path):
    """Islands started with num_islands 2 and 3 were both accepted, and each took 1/num_islands
    of the data by its own count: their shards overlapped. The count a quorum of the islands says
    is the run's (one island's alone refuses no one: tests/adversarial/test_slots.py)."""
    config = run_config()
    sync = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path))
    sync.join(0, 1, SPECS, num_islands=2)
    sync.join(1, 1, SPECS, num_islands=3)  # no count is the run's yet: neither refuses the other
    assert sync.run.num_islands == 0
    sync.join(1, 1, SPECS, num_islands=2)  # 2 of 2 say 2: the run's
    assert sync.run.num_islands == 2
    with pytest.raises(Refusal) as err:
        sync.join(1, 1, SPECS, num_islands=3)
    assert err.value.reason == "num_islands_mismatch"
    assert "num_islands=3" in str(err.value) and "num_islands=2" in str(err.value)
    sync.join(1, 1, SPECS)  # an older client says no count: accepted
    with pytest.raises(Refusal, match=r"island 2 is not one of the run's num_islands=2 islands \(0..1\)"):
        sync.join(2, 1, SPECS)
    sync.seed(0, 0, get_codec("fp32").encode(initial_fragments(config)[0]))
    sync.checkpoint()
    sync.shutdown()
    restarted = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path))
    with pytest.raises(Refusal, match="num_islands=2"):
        restarted.join(1, 1, SPECS, num_islands=3)
    assert restarted.join(1, 1, SPECS, num_islands=2).session


def test_a_second_process_as_a_live_island_is_refused_and_a_restart_gets_in_once_the_old_one_is_silent():
    """Two processes with one index took the island's session from each other on every call
    (wrong_session both ways). A join as an island heard from within RUNNING_WINDOW is refused,
    unless it comes from the client holding the island's session."""
    from lightning_diloco.core.protocol import RUNNING_WINDOW

    clock = FakeClock()
    sync = Synchronizer(run_config(), SynchronizerSettings(clock=clock))
    first = sync.join(0, 1, SPECS, previous_session="").session
    clock.advance(RUNNING_WINDOW / 2)
    sync.heartbeat(0, 5, 0.1, session=first)
    clock.advance(RUNNING_WINDOW / 2)
    with pytest.raises(Refusal) as err:
        sync.join(0, 1, SPECS, previous_session="")  # a second process
    assert err.value.reason == "island_running" and "island 0 is already running" in str(err.value)
    assert "DILOCO_ISLAND" in str(err.value) and "stop its running process" in str(err.value)
    sync.heartbeat(0, 6, 0.1, session=first)  # the running island kept its session
    again = sync.join(0, 1, SPECS, previous_session=first).session  # its own client joining again
    clock.advance(RUNNING_WINDOW + 0.1)  # the island crashed: silent since
    restarted = sync.join(0, 1, SPECS, previous_session="").session
    assert len({first, again, restarted}) == 3 and sync.status().refused == {"island_running": 1}


def test_the_operator_pins_the_island_count_and_a_count_no_island_can_have_is_refused(tmp_path):
    """As --layout-hash for the model: a first joiner cannot set a count that locks the others out."""
    config = run_config()
    sync = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path, num_islands=2))
    with pytest.raises(Refusal, match="run has num_islands=2 .*--num-islands"):
        sync.join(0, 1, SPECS, num_islands=3)
    for island, count in [(3, 3), (0, -1), (0, 10**6)]:
        with pytest.raises(Refusal) as err:
            sync.join(island, 1, SPECS, num_islands=count)
        assert err.value.reason == "bad_island" and f"num_islands={count}" in str(err.value)
    sync.join(1, 1, SPECS, num_islands=2)
    sync.seed(1, 0, get_codec("fp32").encode(initial_fragments(config)[0]))
    sync.checkpoint()
    sync.shutdown()
    with pytest.raises(ValueError, match="--num-islands 3, but the run in .* has num_islands=2"):
        Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, num_islands=3))
    Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, num_islands=2)).shutdown()  # the refused start left the directory
