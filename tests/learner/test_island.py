"""IslandLearner mechanics against an in-process synchronizer: timing, apply modes, failures."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.config import CodecConfig, MergeConfig, OuterConfig, RunConfig, ScheduleConfig
from lightning_diloco.core.fragments import build_layout, flatten_fragment
from lightning_diloco.learner.island import IslandLearner
from lightning_diloco.synchronizer.service import Contribution, Refusal, Synchronizer
from lightning_diloco.transport.client import PushReply, SynchronizerError
from tests.helpers import SPECS


class ServiceLink:
    """The client's interface over an in-process Synchronizer (no sockets), with fault switches."""

    def __init__(self, service: Synchronizer) -> None:
        self.service = service
        self.down = False
        self.gate: threading.Event | None = None  # when set, pushes wait for it

    def _check(self):
        if self.down:
            raise SynchronizerError(None, "unreachable", "synchronizer is down (test)")

    def heartbeat(self, island, steps, step_time):
        self._check()
        self.service.heartbeat(island, steps, step_time)
        return self.service.versions()

    def seed(self, island, p, value):
        return self.service.seed(island, p, get_codec("fp32").encode(value)), 0

    def pull(self, p, newer_than=-1, wait=0.0):
        self._check()
        return self.service.pull(p, newer_than, wait)

    def push(self, *, wait, **fields):
        if self.gate is not None:
            self.gate.wait(10)
        self._check()
        try:
            r = self.service.push(Contribution(**fields), timeout=wait)
        except Refusal as refusal:
            raise SynchronizerError(None, refusal.reason, str(refusal)) from None
        return PushReply(r.fragment, r.version, r.base_version, r.codec, bytearray(r.payload.numpy().tobytes()), r.contributors, r.reason)

    def close(self):
        if self.gate is not None:
            self.gate.set()


def _config(P=2, H=4, tau=1, apply="overwrite", alpha=0.5, lr=1.0, momentum=0.0):
    return RunConfig(
        schedule=ScheduleConfig(num_fragments=P, sync_every=H, overlap_steps=tau, apply=apply, mix_alpha=alpha),
        merge=MergeConfig(grace_gamma=0.0),
        outer=OuterConfig(lr=lr, momentum=momentum),
        codec=CodecConfig(uplink="fp32", downlink="fp32"),
    )


def _island(config, island=0, service=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s.shape, generator=g) for s in SPECS]
    layout = build_layout(SPECS, config.schedule.num_fragments)
    service = service or Synchronizer(config)
    service.join(island, 1, SPECS)
    link = ServiceLink(service)
    learner = IslandLearner(params, layout, config, island=island, link=link, heartbeat_every=60)
    learner.start()
    return learner, link, params, service


def _settle(learner):
    for flight in learner.in_flight.values():
        try:
            flight.future.result(timeout=10)
        except Exception:
            pass


def _step(learner, params, delta=0.01, tokens=10.0):
    with torch.no_grad():
        for p in params:
            p.add_(delta)  # stands in for an inner optimizer step
    learner.after_step(tokens)


@pytest.fixture
def closing():
    learners = []
    yield learners.append
    for learner in learners:
        learner.close()


def test_a_fresh_island_seeds_and_starts_from_the_global_model(closing):
    config = _config()
    first, _, params0, service = _island(config, seed=0)
    second, _, params1, _ = _island(config, island=1, service=service, seed=1)
    closing(first), closing(second)
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))  # island 1 took island 0's seed


def test_reply_is_applied_exactly_tau_steps_after_the_send(closing):
    config = _config(P=2, H=4, tau=1)  # fragment 0 due at steps 2, 6; fragment 1 at 4, 8
    learner, link, params, service = _island(config)
    closing(learner)
    applied_at = {}
    for t in range(1, 9):
        before = learner.counters["applied"]
        _step(learner, params)
        _settle(learner)
        if learner.counters["applied"] > before:
            applied_at[t] = before
    assert sorted(applied_at) == [3, 5, 7]  # sends at 2, 4, 6 land at 3, 5, 7; the one at 8 is in flight
    assert learner.versions == [2, 1] and 1 in learner.in_flight


def test_overwrite_with_plain_averaging_keeps_a_single_island_on_its_own_trajectory(closing):
    config = _config(P=1, H=2, tau=0)
    learner, link, params, _ = _island(config)
    closing(learner)
    expected = [p.clone() for p in params]
    for _ in range(6):
        _step(learner, params)
        for e in expected:
            e.add_(0.01)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params, expected))
    assert learner.versions == [3]


def test_mix_blends_local_and_global(closing):
    config = _config(P=1, H=2, tau=1, apply="mix", alpha=0.25, lr=0.5)
    learner, link, params, service = _island(config)
    closing(learner)
    _step(learner, params)
    _step(learner, params)  # sent after step 2
    _settle(learner)
    sent = flatten_fragment([p for p in params])
    _step(learner, params)  # applied after step 3
    global_value = service.pull(0)[1]
    # local moved on by one more step (+0.01) after the snapshot
    local = sent + 0.01
    expected = 0.25 * local + 0.75 * global_value
    assert torch.allclose(flatten_fragment(params), expected, atol=1e-6)


def test_rebase_keeps_the_progress_made_since_the_snapshot(closing):
    config = _config(P=1, H=4, tau=2, apply="rebase", lr=0.5)
    learner, link, params, service = _island(config)
    closing(learner)
    for _ in range(4):
        _step(learner, params)  # sent after step 4
    _settle(learner)
    for _ in range(2):
        _step(learner, params)  # applied after step 6
    global_value = service.pull(0)[1]
    assert torch.allclose(flatten_fragment(params), global_value + 0.02, atol=1e-6)
    assert learner.steps[0] == 2  # the two steps since the snapshot still count


def test_a_fragment_in_flight_is_skipped_not_sent_twice(closing):
    config = _config(P=1, H=1, tau=0)
    config = RunConfig(schedule=ScheduleConfig(num_fragments=1, sync_every=2, overlap_steps=1), merge=config.merge,
                       outer=config.outer, codec=config.codec)
    learner, link, params, _ = _island(config)
    closing(learner)
    link.gate = threading.Event()  # the synchronizer holds every push
    for _ in range(6):
        _step(learner, params)
    assert learner.counters["sent"] == 1 and learner.counters["skipped"] == 2
    link.gate.set()


def test_training_goes_on_while_the_synchronizer_is_down_and_resyncs_after(closing):
    config = _config(P=1, H=2, tau=1)
    learner, link, params, service = _island(config)
    closing(learner)
    link.down = True
    for _ in range(6):
        _step(learner, params)
        _settle(learner)
    assert learner.counters["failed"] >= 2 and learner.counters["applied"] == 0
    assert learner.versions == [0] and learner.steps[0] == 6  # counters keep accumulating
    link.down = False
    for _ in range(4):
        _step(learner, params)
        _settle(learner)
    assert learner.counters["applied"] >= 1 and learner.versions[0] >= 1 and learner.reachable


def test_a_stale_base_is_answered_by_pulling_the_current_value(closing):
    config = _config(P=1, H=1, tau=0)
    config = RunConfig(schedule=config.schedule, merge=MergeConfig(grace_gamma=0.0, history=1), outer=config.outer, codec=config.codec)
    service = Synchronizer(config)
    learner, link, params, _ = _island(config, service=service)
    other, _, other_params, _ = _island(config, island=1, service=service, seed=5)
    closing(learner), closing(other)
    _step(other, other_params)  # version 1; history of 1 forgets version 0
    _step(learner, params)  # pushes against version 0: stale -> pull
    assert learner.counters["repulled"] == 1 and learner.versions == [1]
    assert torch.allclose(flatten_fragment(params), service.pull(0)[1])


def test_state_dict_round_trips_and_refuses_another_model(closing):
    config = _config()
    learner, _, params, _ = _island(config)
    closing(learner)
    for _ in range(3):
        _step(learner, params)
    state = learner.state_dict()
    assert state["step"] == 3 and len(state["bases"]) == 2
    learner.load_state_dict(state)
    with pytest.raises(ValueError, match="does not match this model"):
        learner.load_state_dict({**state, "layout_hash": "x"})


def test_sync_threads_run_torch_single_threaded_and_leave_the_training_thread_alone(closing, two_torch_threads):
    learner, *_ = _island(_config())
    closing(learner)
    assert learner._executor.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == 2
