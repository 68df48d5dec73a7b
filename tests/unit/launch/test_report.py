"""Goodput and downtime from sampled progress, by hand-computed examples."""

import pytest

from lightning_diloco.launch.report import RecoveryClock, Sample, build_report, downtime, useful_time
from lightning_diloco.core.protocol import IslandStatus, SynchronizerStatus


def test_useful_time_credits_every_advancing_interval():
    assert useful_time([(0, 0), (1, 10), (2, 20), (3, 20), (4, 30)]) == 3.0


def test_rolled_back_steps_are_not_useful():
    # reached step 30 by t=3, crashed, restarted from the checkpoint at step 10 at t=5, then 10 -> 40
    series = [(0, 0), (1, 10), (2, 20), (3, 30), (5, 10), (6, 20), (7, 30), (8, 40)]
    # kept: 0->10 (1 s), then 10->20, 20->30, 30->40 after the restart (3 s); 10->20, 20->30 before it are lost
    assert useful_time(series) == 4.0


def _samples(progress, alive=(0, 1)):
    return [Sample(float(t), g, {0: t, 1: t}, set(alive)) for t, g in enumerate(progress)]


def test_downtime_counts_stalls_that_progress_ends():
    samples = _samples([0, 0, 0, 1, 2, 2, 2, 3, 3, 3])
    total, longest = downtime(samples)
    assert total == 2.0 and longest == 2.0  # t 4->6; start-up (0->3) and the tail (7->9) are not interruptions


def test_stalls_no_longer_than_the_threshold_are_not_downtime():
    samples = _samples([0, 1, 1, 2, 2, 2, 3])  # stalls of 1 s and 2 s
    assert downtime(samples, longer_than=1.0) == (2.0, 2.0)


def test_no_downtime_while_no_island_is_alive():
    alive = [{0}, {0}, set(), set(), {0}, {0}]
    samples = [Sample(float(t), g, {}, a) for t, (g, a) in enumerate(zip([1, 2, 2, 2, 2, 3], alive))]
    assert downtime(samples) == (2.0, 2.0)  # 1->2 (island 0 alive at its start) and 3->4 (back at its end)


def test_excluded_windows_are_not_downtime():
    samples = _samples([1, 2, 2, 2, 2, 3])
    assert downtime(samples) == (3.0, 3.0)
    assert downtime(samples, [(1.5, 2.5)]) == (1.0, 1.0)  # 1->2 and 2->3 overlap the window


def test_goodput_is_useful_over_allocated_island_time():
    samples = [Sample(float(t), t, {0: t, 1: min(t, 2)}, {0, 1}) for t in range(5)]  # island 1 stalls after t=2
    report = build_report("x", 2, samples, {0: 4.0, 1: 4.0}, rollback_steps=False)
    assert report.useful_s == {0: 4.0, 1: 2.0}
    assert report.goodput == pytest.approx(6.0 / 8.0)
    assert "goodput 75.0%" in report.summary()
    # an island that finished its work at t = 2 is not allocated after that
    done = build_report("x", 2, samples, {0: 4.0, 1: 2.0}, rollback_steps=False, finished_at={1: 2.0})
    assert done.goodput == pytest.approx(6.0 / 6.0)


def _status(incarnation, **accepted):
    islands = {int(i[1:]): IslandStatus(live=True, world_size=1, steps=0, schedule_step=0, step_time_s=0.1, accepted=n,
                                        seen_s_ago=0.0) for i, n in accepted.items()}
    return SynchronizerStatus(shard=0, num_shards=1, incarnation=incarnation, layout_hash="h", outer_steps=0, run_step=0,
                              sync_every=1, num_fragments=1, min_quorum=1, bytes_in=0, bytes_out=0, checkpoint_failures=0,
                              last_checkpoint_error="", last_checkpoint_outer_steps=0, islands=islands)


def test_recovery_is_the_first_contribution_accepted_after_a_restart():
    clock = RecoveryClock()
    clock.observe(_status("a", i1=40), now=10.0)
    clock.island_restarted(1, now=11.0)
    clock.observe(_status("a", i1=40), now=12.0)  # still starting
    clock.observe(_status("a", i1=41), now=13.5)
    assert clock.recoveries == [2.5]


def test_recovery_counts_from_zero_again_after_the_synchronizer_restarts():
    # the island restarts while the synchronizer is down; the new synchronizer counts from 0,
    # and 7 accepted is a recovery even though the old incarnation had counted 40
    clock = RecoveryClock()
    clock.observe(_status("a", i1=40), now=10.0)
    clock.island_restarted(1, now=11.0)
    clock.observe(_status("b", i1=0), now=14.0)
    assert clock.recoveries == []
    clock.observe(_status("b", i1=7), now=15.0)
    assert clock.recoveries == [4.0] and clock.accepted == {1: 7}
