"""The version log (synchronizer/version_log.py): a version any caller saw survives a kill that
came before its checkpoint, taken back from an island that holds it, and only with its digest."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.state import FragmentState
from lightning_diloco.learner.island import IslandLearner
from lightning_diloco.learner.leader import LeaderSync, sync_pool
from lightning_diloco.synchronizer import version_log
from lightning_diloco.synchronizer.local_link import LocalLink
from lightning_diloco.synchronizer.requests import Refusal
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.synchronizer.version_log import RECOVERY_SETTLE
from tests.helpers import SPECS, FakeClock, contribution, initial_fragments, layout, run_config, with_peer_votes

FP32 = get_codec("fp32")


def _killed_after_versions(tmp_path, config, versions: int, pulls: dict | None = None) -> torch.Tensor:
    """A synchronizer checkpointed at version 0 that published ``versions`` more of fragment 1,
    then died without a checkpoint (its directory released, as the kernel does at a SIGKILL).
    Returns the value an island pulled at the last version (``pulls``: version -> each one's)."""
    sync = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path))
    sync.join(0, 1, SPECS)
    for p, value in initial_fragments(config).items():
        sync.seed(0, p, FP32.encode(value))
    sync.checkpoint()
    numel = layout(config).fragment_numel(1)
    for v in range(versions):
        sync.push(contribution(config, 0, 1, torch.full((numel,), 0.01 * (v + 1)), round=v + 1, base_version=v, seq=v))
        sync.poll()
        if pulls is not None:
            pulls[v + 1] = sync.pull(1)[1]
    version, pulled = sync.pull(1)
    assert version == versions
    sync.directory.release()  # no final checkpoint: the kill
    return pulled


def test_a_version_published_after_the_checkpoint_is_taken_back_only_from_an_island_holding_it(tmp_path):
    config = run_config(downlink="int4")  # islands hold the published value, not the exact one
    pulled = _killed_after_versions(tmp_path, config, 3)
    assert version_log.read(tmp_path)[1][-1] == (3, version_log.value_digest(pulled))

    restarted = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path, recovery_wait=60))
    assert restarted.versions() == {0: 0, 1: -1}  # not version 0 again: islands hold 3
    # the run's progress does not go back while it waits: its 3 outer steps were taken (an operator's
    # dashboard, and the launcher's report, read a drop as steps lost)
    assert restarted.status().outer_steps == 3
    restarted.join(0, 1, SPECS)
    with pytest.raises(Refusal, match="waits for an island to give back its version 3"):
        restarted.pull(1)
    with pytest.raises(Refusal, match="give back"):
        restarted.push(contribution(config, 0, 1, torch.zeros_like(pulled), round=4, base_version=3, seq=10))
    # an island whose value is not version 3's (its own, or a hostile one's) cannot make it so
    assert restarted.seed(0, 1, FP32.encode(pulled + 1e-3)) is False
    assert restarted.versions()[1] == -1
    assert restarted.seed(0, 1, FP32.encode(pulled)) is True
    assert restarted.versions() == {0: 0, 1: 3}
    version, value = restarted.pull(1)
    assert version == 3 and torch.equal(value, pulled)
    assert torch.equal(restarted.export(1)[1], pulled)  # taken as the exact value too (one quantisation step lost)
    # islands holding version 3 are sent the next one as a step from it, not whole
    restarted.push(contribution(config, 0, 1, torch.full_like(pulled, 0.01), round=4, base_version=3, seq=11))
    restarted.poll()
    [update] = restarted.run.fragments[1].updates_for(0, 3)
    assert (update.version, update.base_version) == (4, 3)
    # the next checkpoint compacts the log to one line per fragment
    restarted.checkpoint()
    assert len((tmp_path / version_log.FILE).read_text().splitlines()) == 2
    assert version_log.read(tmp_path)[1] == [(4, version_log.value_digest(restarted.pull(1)[1]))]
    restarted.shutdown()


def test_with_no_island_giving_it_back_the_checkpoint_is_served_after_the_wait_and_said_loudly(tmp_path, caplog):
    config = run_config()
    _killed_after_versions(tmp_path, config, 2)
    with (tmp_path / version_log.FILE).open("ab") as f:
        f.write(b'{"fragment": 1, "vers')  # a line a kill cut short: never fsync'd, never seen
    clock = FakeClock()
    restarted = Synchronizer(config, SynchronizerSettings(clock=clock, checkpoint_dir=tmp_path, recovery_wait=60))
    assert restarted.versions()[1] == -1 and restarted.status().outer_steps == 2
    clock.advance(61)
    with caplog.at_level(logging.ERROR):
        assert restarted.versions() == {0: 0, 1: 0}
    assert restarted.status().outer_steps == 0  # the versions lost are no longer counted
    assert "no island gave back its version 2" in caplog.text and "LOST" in caplog.text
    restarted.directory.release()
    # the fallback is logged too: the next restart serves version 0 at once
    again = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path))
    assert again.versions() == {0: 0, 1: 0}
    again.shutdown()


def test_a_version_the_log_cannot_hold_is_not_published():
    config = run_config(downlink="int4")
    frag = FragmentState(torch.ones(64), config)

    def disk_full(version, value):
        raise OSError(28, "No space left on device")

    frag.publish_hook = disk_full
    before = (frag.value.clone(), frag.published_value())
    with pytest.raises(OSError):
        frag.apply(torch.full((64,), 0.1))
    assert frag.version == 0 and torch.equal(frag.value, before[0]) and torch.equal(frag.published_value(), before[1])
    assert frag.published.version == 0 and not frag.published.steps


def test_an_island_leader_gives_back_the_fragment_it_holds_once_its_heartbeat_shows_it_waiting(tmp_path):
    config = run_config(downlink="int4")
    pulled = _killed_after_versions(tmp_path, config, 2)
    restarted = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path, recovery_wait=60))
    link = LocalLink(restarted)
    link.join(0, 1, SPECS)
    held = {0: (0, initial_fragments(config)[0]), 1: (2, pulled)}
    leader = LeaderSync(link, island=0, uplink=get_codec("int4"), feedback=False, layout_hash=layout(config).hash,
                        executor=sync_pool(0, 1), progress=lambda: (0, 0.0, 0), holds=held.get)
    try:
        beat = link.heartbeat(0, 0, 0.0)
        leader._give_back([p for p, v in beat.versions.items() if v < 0])  # what its heartbeat thread does
        assert restarted.versions() == {0: 0, 1: 2}
        assert torch.equal(restarted.pull(1)[1], pulled)
    finally:
        leader.close()
        link.close()
        restarted.shutdown()


def test_when_no_island_holds_the_last_version_the_newest_one_offered_is_taken_once_the_restart_settles(tmp_path, caplog):
    """Killed between logging a version and anyone pulling it: the islands hold the one before."""
    config = run_config()
    pulls: dict = {}
    _killed_after_versions(tmp_path, config, 3, pulls)
    clock = FakeClock()
    restarted = Synchronizer(config, SynchronizerSettings(clock=clock, checkpoint_dir=tmp_path, recovery_wait=60))
    restarted.join(0, 1, SPECS)
    assert restarted.seed(0, 1, FP32.encode(pulls[1])) is False
    assert restarted.seed(0, 1, FP32.encode(pulls[2])) is False  # version 3 may still come back
    assert restarted.versions()[1] == -1
    clock.advance(RECOVERY_SETTLE)
    with caplog.at_level(logging.ERROR):
        assert restarted.versions()[1] == 2
    assert "versions 3-3 are LOST" in caplog.text
    assert torch.equal(restarted.pull(1)[1], pulls[2])
    assert version_log.read(tmp_path)[1] == [(2, version_log.value_digest(pulls[2]))]  # a restart now serves 2 at once
    restarted.shutdown()


def test_once_every_island_of_the_run_offered_an_older_version_the_newest_offered_is_taken_at_once(tmp_path):
    config = run_config()
    pulls: dict = {}
    _killed_after_versions(tmp_path, config, 3, pulls)
    restarted = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path, recovery_wait=60, num_islands=2))
    for i in range(2):
        restarted.join(i, 1, SPECS, num_islands=2)
    assert restarted.seed(0, 1, FP32.encode(pulls[2])) is False  # island 1 may hold version 3
    assert restarted.seed(1, 1, FP32.encode(pulls[1])) is False  # it did not: 2 is the newest any island holds
    assert restarted.versions()[1] == 2 and torch.equal(restarted.pull(1)[1], pulls[2])
    restarted.shutdown()


def test_islands_holding_only_the_checkpoints_version_have_it_served_once_the_restart_settles(tmp_path):
    """Killed between logging version 1 and anyone pulling it: every island holds version 0, the checkpoint's."""
    config = run_config()
    pulls: dict = {}
    _killed_after_versions(tmp_path, config, 1, pulls)
    restarted = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path, recovery_wait=60, num_islands=1))
    restarted.join(0, 1, SPECS, num_islands=1)
    assert restarted.seed(0, 1, FP32.encode(initial_fragments(config)[1])) is True
    assert restarted.versions()[1] == 0
    restarted.shutdown()


def test_a_brand_new_island_joining_during_a_recovery_is_served_its_first_pull_once_the_version_is_given_back(tmp_path):
    """A new island's start offers its own first weights (its heartbeat shows the fragment waiting)
    and pulls: the pull was refused, and it could not start. It has nothing to give back, so it
    waits for an island that has, and starts from the version given back."""
    config = run_config(downlink="int4")
    pulled = _killed_after_versions(tmp_path, config, 3)
    restarted = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path, recovery_wait=60))
    restarted.join(0, 1, SPECS)
    fresh = LocalLink(restarted)
    fresh.join(5, 1, SPECS)
    got: dict = {}
    try:
        assert fresh.seed(5, 1, torch.randn_like(pulled)) == (False, -1)  # its own first weights: not version 3
        waiting = threading.Thread(target=lambda: got.update(pull=fresh.pull(1)), name="diloco-test-fresh-pull")
        waiting.start()
        assert restarted.seed(0, 1, FP32.encode(pulled)) is True  # island 0 holds version 3: given back
        waiting.join(30)
        version, value = got["pull"]
        assert version == 3 and torch.equal(value, pulled)
    finally:
        fresh.close()
        restarted.shutdown()


def test_a_pull_waits_for_a_recovery_no_longer_than_its_bound_and_only_from_an_island_with_nothing_to_give(
        tmp_path, monkeypatch):
    config = run_config(downlink="int4")
    pulled = _killed_after_versions(tmp_path, config, 2)
    restarted = Synchronizer(config, SynchronizerSettings(clock=FakeClock(), checkpoint_dir=tmp_path, recovery_wait=60))
    monkeypatch.setattr(version_log, "RECOVERY_PULL_WAIT", 0.3)
    try:
        for island in (0, 5):
            restarted.join(island, 1, SPECS)
        with pytest.raises(Refusal, match="give back its version 2"):  # it may hold version 2: told at once
            restarted.pull(1, island=0)
        assert restarted.seed(5, 1, FP32.encode(pulled + 1.0)) is False
        with pytest.raises(Refusal, match="give back its version 2"):  # nobody gives it back: refused after the wait
            restarted.pull(1, island=5)
    finally:
        restarted.shutdown()


@pytest.mark.parametrize("downlink", ["fp32", "int4"])
def test_a_restarted_synchronizer_takes_back_the_versions_a_learner_island_received_as_updates(tmp_path, downlink):
    """A learner island that received its versions from the subscription (not pulled) gives them
    back after a kill, with either downlink. With fp32 the island held base + an fp32 delta, a
    rounding away from the logged value: no version was ever taken back (issue 48, 4(a))."""
    config = run_config(downlink=downlink)
    sync = Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path)).start()
    link = LocalLink(sync)
    learner = None
    try:
        info = link.join(0, 1, SPECS)
        with_peer_votes(sync, range(4))  # a lone entry does not wait for a peer's vote
        g = torch.Generator().manual_seed(0)
        # weights near 0 beside their steps: an fp32 delta is inexact where a weight's sign or
        # binade changes (elsewhere base + (new - base) is new exactly)
        params = [1e-3 * torch.randn(s.shape, generator=g) for s in SPECS]
        learner = IslandLearner(params, layout(config), config, island=0, link=link, heartbeat_every=60)
        learner.start(run_step=info.run_step)
        sync.checkpoint()  # at version 0: every later version is the log's alone
        for _ in range(12):
            with torch.no_grad():
                for p in params:
                    p.add_(0.01 * torch.randn(p.shape, generator=g))  # stands in for an inner step
            learner.after_step(10.0)
            assert learner.inbox.wait(lambda: all(learner.settled(p) for p in learner.in_flight), 120)
        held = {p: learner.fragments[p].held() for p in range(2)}
        assert min(v for v, _ in held.values()) >= 2, held  # versions came as updates, not only the first pull
    finally:
        if learner is not None:
            learner.close()
        link.close()
        sync.shutdown()  # no final checkpoint: the kill
    # a run of one island: what it holds is taken at once, the last version or not (its send's
    # round may have closed before it applied the version)
    _give_back_after_a_kill(config, tmp_path, held)


def _give_back_after_a_kill(config, tmp_path, held: dict) -> None:
    """A synchronizer restarted on ``tmp_path`` (a run of one island) is offered what the island
    holds (``held``: fragment -> (version, value)), as its heartbeat thread does when it sees the
    fragments waiting, and takes every one of them back: nothing lost."""
    restarted = Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, recovery_wait=60, num_islands=1))
    assert restarted.versions() == dict.fromkeys(held, -1)
    restarted_link = LocalLink(restarted)
    restarted_link.join(0, 1, SPECS, num_islands=1)
    leader = LeaderSync(restarted_link, island=0, uplink=get_codec("fp32"), feedback=False,
                        layout_hash=layout(config).hash, executor=sync_pool(0, 1), progress=lambda: (0, 0.0, 0),
                        holds=held.get)
    try:
        leader._give_back(sorted(held))
        assert restarted.versions() == {p: v for p, (v, _) in held.items()}
        for p, (_, value) in held.items():
            assert torch.equal(restarted.pull(p)[1], value)
    finally:
        leader.close()
        restarted_link.close()
        restarted.shutdown()


def test_an_island_that_took_several_int4_steps_at_one_step_boundary_holds_the_published_value_and_gives_it_back(tmp_path):
    """An island busy while three versions were published (a long validation) takes their int4
    steps at one step boundary and applies them once. Added to its base one at a time, as the
    synchronizer published them, they land on the published value bit for bit, which a restarted
    synchronizer takes back. Summed first, they did not, nor did any later version built on them:
    the island gave nothing back (issue 48, 4)."""
    config = run_config(num_fragments=1, downlink="int4")
    sync = Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path)).start()
    link = LocalLink(sync)
    learner = None
    try:
        info = link.join(0, 1, SPECS)
        with_peer_votes(sync, range(4))  # a lone entry does not wait for a peer's vote
        g = torch.Generator().manual_seed(0)
        params = [torch.randn(s.shape, generator=g) for s in SPECS]
        learner = IslandLearner(params, layout(config), config, island=0, link=link, heartbeat_every=60)
        learner.start(run_step=info.run_step)
        sync.checkpoint()  # at version 0: every later version is the log's alone
        sync.join(1, 1, SPECS)  # another island publishes versions 1-3 while island 0 takes no step
        numel = layout(config).fragment_numel(0)
        for v in range(3):
            sync.push(contribution(config, 1, 0, 0.05 * torch.randn(numel, generator=g), round=v + 1, base_version=v, seq=v))
            assert learner.inbox.wait(lambda: learner.inbox.received[0] == v + 1, 60), v  # noqa: B023 - called here
        assert len(learner.inbox.fresh[0].steps) == 3  # three int4 steps from version 0, not yet taken
        learner.after_step(10.0)
        assert learner.counters["received"] == 1  # the island's parameters changed once
        held = learner.fragments[0].held()
        version, published = sync.pull(0)
        assert held[0] == version == 3
        assert torch.equal(held[1], published)
    finally:
        if learner is not None:
            learner.close()
        link.close()
        sync.shutdown()  # no final checkpoint: the kill
    _give_back_after_a_kill(config, tmp_path, {0: held})
