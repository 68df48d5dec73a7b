"""The synchronizer's rounds in-process: learners are threads, the rules are DESIGN.md section 2."""

import threading
import time
from dataclasses import replace

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.fragments import TensorSpec, split_fragment
from lightning_diloco.core.merge import contribution_weight, merge_outer_gradients
from lightning_diloco.synchronizer.service import Refusal, Synchronizer
from tests.helpers import SPECS, contribution, initial_fragments, layout, run_config


def _started(config, islands, **kwargs):
    sync = Synchronizer(config, **kwargs)
    for i in range(islands):
        sync.join(i, 1, SPECS)
    for p, value in initial_fragments(config).items():
        sync.seed(0, p, get_codec("fp32").encode(value))
    return sync


def _push_async(sync, c, results, timeout=10.0):
    def run():
        try:
            results[c.island] = sync.push(c, timeout=timeout)
        except Exception as err:  # surfaced by the test's assertions
            results[c.island] = err

    t = threading.Thread(target=run)
    t.start()
    return t


def test_first_seed_wins_and_versions_start_at_zero():
    config = run_config()
    sync = _started(config, 1)
    assert sync.versions() == {0: 0, 1: 0}
    other = torch.zeros(layout(config).fragment_numel(0))
    assert sync.seed(1, 0, get_codec("fp32").encode(other)) is False
    assert torch.equal(sync.pull(0)[1], initial_fragments(config)[0])


def test_single_island_round_is_one_outer_step_of_its_own_delta():
    config = run_config()
    sync = _started(config, 1)
    base = initial_fragments(config)[0]
    delta = torch.full_like(base, 0.01)
    reply = sync.push(contribution(config, 0, 0, delta))
    assert reply.version == 1 and reply.contributors == 1
    # outer gradient -delta, Nesterov first step: theta -= lr * (g + mu * g) = lr * (1 + mu) * delta
    expected = base + 0.7 * 1.9 * delta
    assert torch.allclose(sync.pull(0)[1], expected, atol=1e-6)
    assert torch.allclose(get_codec("fp32").decode(reply.payload, base.numel()), expected - base, atol=1e-6)


def test_round_closes_with_quorum_without_the_slowest_island():
    config = run_config(min_quorum=2, gamma=0.0)
    sync = _started(config, 3)
    frag = initial_fragments(config)[1]
    results = {}
    threads = [_push_async(sync, contribution(config, i, 1, torch.randn_like(frag) * 0.01), results) for i in (0, 1)]
    for t in threads:
        t.join(10)
    assert results[0].version == results[1].version == 1
    assert results[0].contributors == 2 and "quorum reached" in results[0].reason
    assert sync.status()["live_islands"] == [0, 1, 2]  # island 2 was alive, just slow


def test_no_merge_below_quorum_and_status_says_so():
    config = run_config(min_quorum=2)
    sync = _started(config, 2)
    with pytest.raises(TimeoutError, match="waiting for quorum: 1 of 2"):
        sync.push(contribution(config, 0, 0, torch.zeros(layout(config).fragment_numel(0))), timeout=0.3)
    assert sync.versions()[0] == 0
    assert sync.status()["rounds"][0]["open_contributors"] == 1


def test_an_island_whose_heartbeats_stopped_never_stalls_a_round():
    config = run_config(min_quorum=1, gamma=0.9, overlap=3)
    sync = _started(config, 2, liveness_timeout=0.3)
    sync.heartbeat(0, 10, 5.0)  # long steps: a grace window of up to 13.5 s if island 1 counted
    time.sleep(0.4)
    sync.heartbeat(0, 11, 5.0)  # island 0 stays alive, island 1 went silent
    start = time.monotonic()
    reply = sync.push(contribution(config, 0, 0, torch.zeros(layout(config).fragment_numel(0))), timeout=5)
    assert time.monotonic() - start < 1.0
    assert "every live island" in reply.reason and sync.status()["live_islands"] == [0]


def test_grace_window_admits_an_island_inside_it_and_not_one_after_it():
    config = run_config(min_quorum=1, gamma=0.5, overlap=2)
    sync = _started(config, 2)
    for i in (0, 1):
        sync.heartbeat(i, 1, 1.0)  # grace = 0.5 * (2 * 1.0 - 0 - sync) ~ 1 s
    numel = layout(config).fragment_numel(0)
    results = {}
    t0 = _push_async(sync, contribution(config, 0, 0, torch.full((numel,), 0.01)), results)
    time.sleep(0.3)
    t1 = _push_async(sync, contribution(config, 1, 0, torch.full((numel,), 0.02)), results)
    t0.join(5), t1.join(5)
    assert results[0].version == results[1].version == 1 and results[0].contributors == 2

    results.clear()
    t0 = _push_async(sync, contribution(config, 0, 0, torch.full((numel,), 0.01), base_version=1, seq=1), results)
    t0.join(5)  # closes when the ~1 s grace elapses
    assert results[0].version == 2 and results[0].contributors == 1 and "grace window elapsed" in results[0].reason
    late = sync.push(contribution(config, 1, 0, torch.full((numel,), 0.02), base_version=1, seq=1), timeout=5)
    assert late.version == 3  # arrived after the window: merged into the next round


def test_merge_weights_contributions_by_tokens_squared_over_steps():
    config = run_config(min_quorum=2, num_fragments=1)
    sync = _started(config, 2)
    numel = layout(config).fragment_numel(0)
    g = torch.Generator().manual_seed(3)
    deltas = [torch.randn(numel, generator=g) * 0.01 for _ in range(2)]
    results = {}
    ts = [_push_async(sync, contribution(config, i, 0, deltas[i], tokens=100.0 * (i + 1), steps=4 + i), results) for i in range(2)]
    for t in ts:
        t.join(10)
    specs = layout(config).fragment_specs(0)
    weights = [contribution_weight(100.0, 4), contribution_weight(200.0, 5)]
    merged = merge_outer_gradients([split_fragment(-d, specs) for d in deltas], weights, [s.role for s in specs], "rda")
    outer = torch.cat([m.reshape(-1) for m in merged])
    expected = initial_fragments(config)[0] - 0.7 * 1.9 * outer
    assert torch.allclose(sync.pull(0)[1], expected, atol=1e-5)


def test_repeated_push_is_answered_idempotently_never_merged_twice():
    config = run_config()
    sync = _started(config, 1)
    c = contribution(config, 0, 0, torch.full((layout(config).fragment_numel(0),), 0.01))
    first = sync.push(c)
    again = sync.push(c)
    assert again.version == first.version == 1 and torch.equal(again.payload, first.payload)
    assert sync.versions()[0] == 1
    assert sync.status()["accepted"] == {"merged": 1, "duplicate": 1}


def test_pull_waits_for_a_newer_version():
    config = run_config()
    sync = _started(config, 1)
    results = {}

    def pull():
        results["pulled"] = sync.pull(0, newer_than=0, timeout=5)

    t = threading.Thread(target=pull)
    t.start()
    time.sleep(0.1)
    sync.push(contribution(config, 0, 0, torch.full((layout(config).fragment_numel(0),), 0.01)))
    t.join(5)
    assert results["pulled"][0] == 1


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
        "stale": lambda: contribution(config, 0, 0, good, base_version=9),
        "not_joined": lambda: contribution(config, 5, 0, good),
    }
    return builders[reason]()


@pytest.mark.parametrize("reason", ["layout_mismatch", "unknown_fragment", "bad_payload", "non_finite", "bad_counters", "unknown_codec", "stale", "not_joined"])
def test_bad_input_is_refused_with_its_reason_and_the_state_is_unchanged(reason):
    config = run_config()
    sync = _started(config, 1)
    before = {p: sync.pull(p)[1] for p in range(2)}
    with pytest.raises(Refusal) as err:
        sync.push(_bad_input(config, reason), timeout=1)
    assert err.value.reason == reason and str(err.value)
    assert sync.status()["refused"] == {reason: 1}
    assert sync.versions() == {0: 0, 1: 0}
    assert all(torch.equal(sync.pull(p)[1], before[p]) for p in range(2))
    assert sync.status()["rounds"][0]["open_contributors"] == 0


def test_a_model_with_another_layout_cannot_join():
    sync = _started(run_config(), 1)
    other = [*SPECS[:-1], TensorSpec(name="head.weight", shape=(5, 8), dtype="float32", role="dense")]
    with pytest.raises(Refusal, match="head.weight") as err:
        sync.join(1, 1, other)
    assert err.value.reason == "layout_mismatch"


def test_outlier_guard_refuses_an_absurd_outer_gradient():
    config = run_config(outlier_z=10.0, num_fragments=1)
    sync = _started(config, 1)
    numel = layout(config).fragment_numel(0)
    for v in range(3):
        sync.push(contribution(config, 0, 0, torch.full((numel,), 0.01), base_version=v, seq=v))
    with pytest.raises(Refusal, match="running median") as err:
        sync.push(contribution(config, 0, 0, torch.full((numel,), 10.0), base_version=3, seq=3))
    assert err.value.reason == "outlier" and sync.versions() == {0: 3}


def test_restart_from_checkpoint_keeps_versions_fragments_and_momentum(tmp_path):
    config = run_config()
    sync = _started(config, 1, checkpoint_dir=tmp_path, checkpoint_every=1)
    numel = layout(config).fragment_numel(1)
    for v in range(3):
        sync.push(contribution(config, 0, 1, torch.full((numel,), 0.01 * (v + 1)), base_version=v, seq=v))
    restarted = Synchronizer(config, checkpoint_dir=tmp_path)
    assert restarted.versions() == {0: 0, 1: 3}
    for p in range(2):
        a, b = sync.state.fragments[p], restarted.state.fragments[p]
        assert torch.equal(a.value, b.value)
        assert (a.outer.momentum_buffer is None and b.outer.momentum_buffer is None) or torch.equal(a.outer.momentum_buffer, b.outer.momentum_buffer)
    # islands carry on against the restarted synchronizer
    restarted.join(0, 1, SPECS)
    reply = restarted.push(contribution(config, 0, 1, torch.full((numel,), 0.01), base_version=3, seq=3))
    original = sync.push(contribution(config, 0, 1, torch.full((numel,), 0.01), base_version=3, seq=3))
    assert reply.version == original.version == 4
    assert torch.equal(restarted.pull(1)[1], sync.pull(1)[1])
