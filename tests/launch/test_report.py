"""The run report from constructed sample and status streams, by hand-computed examples."""

import pytest

from lightning_diloco.core.protocol import IslandStatus, SynchronizerStatus
from lightning_diloco.launch.report import DEFINITIONS, RecoveryClock, Sample, build_report, downtime, useful_time


def test_a_step_slower_than_a_sample_period_is_useful_a_stall_is_not():
    # steps every 0.5 s sampled every 0.25 s: every other sample sees no change, and all is useful
    series = [(k * 0.25, k // 2) for k in range(41)]
    assert useful_time(series) == pytest.approx(10.0)
    # the same island stopped 5 s (a pause) in the middle: those 5 s are not useful
    paused = [(k * 0.25, int((k * 0.25 if k * 0.25 < 5 else max(5.0, k * 0.25 - 5)) / 0.5)) for k in range(61)]
    # the step gap that holds the pause is credited only its last sample period (the step itself)
    assert useful_time(paused) == pytest.approx(10.0 - 0.5 + 0.25)


def test_rolled_back_steps_are_not_useful():
    # reached step 30 by t=3, crashed, restarted from the checkpoint at step 10 at t=5, then 10 -> 40
    series = [(0, 0), (1, 10), (2, 20), (3, 30), (5, 10), (6, 20), (7, 30), (8, 40)]
    # kept: 0->10 (1 s), then 10->20, 20->30, 30->40 after the restart (3 s); 10->20, 20->30 before it are lost
    assert useful_time(series) == 4.0
    assert useful_time(series, rollback=False) == 6.0  # DiLoCo: a restarted process's count starts anew


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
    # an island that finished its work at its last step (t = 2) is not allocated after that
    done = build_report("x", 2, samples, {0: 4.0, 1: 2.0}, rollback_steps=False, finished=[1])
    assert done.goodput == pytest.approx(6.0 / 6.0)


def test_start_up_is_reported_apart_and_not_counted_against_goodput():
    """Island 1 imports for 20 s before its first step (4 islands on 2 cores); island 0 starts at 5 s.
    Both then step every half second until 40 s, then validate 3 s and exit."""
    samples = []
    for k in range(0, 4 * 43 + 1):
        t = k * 0.25
        steps = {i: int(max(0.0, min(t, 40.0) - start) / 0.5) for i, start in ((0, 5.0), (1, 20.0))}
        samples.append(Sample(t, steps[0] // 4, steps, {0, 1}))
    report = build_report("decoupled diloco", 2, samples, {0: 43.0, 1: 43.0}, rollback_steps=False, finished=[0, 1],
                          ended_at=43.0)
    assert report.startup_s == {0: 5.5, 1: 20.5} and report.training_s == pytest.approx(40.0 - 5.25)  # from the sample before
    assert report.ending_s == pytest.approx(3.0) and report.final_steps == {0: 70, 1: 40}
    assert report.goodput == pytest.approx(1.0)
    text = report.summary()
    assert "start-up island 0 5.5s, island 1 20.5s; training 34.8s; ending 3.0s" in text and "goodput 100.0%" in text
    # the figures are defined once in the report file and the launcher's --help, not after every run
    assert "lightning-diloco run --help" in text and DEFINITIONS["goodput"] not in text
    assert report.to_dict()["definitions"] == DEFINITIONS
    from lightning_diloco.cli import build_parser

    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["run"].format_help().split())
    for name in ("start-up", "goodput", "alive", "useful"):
        assert f"{name}: {DEFINITIONS[name]}" in help_text


def test_a_run_whose_islands_all_crashed_says_failed_and_why():
    samples = [Sample(t * 0.25, 0, {0: 0, 1: 0}, {0, 1} if t < 8 else set()) for t in range(40)]
    why = "island 0 exited with 1 and used up its 5 restarts; its last output: RuntimeError: CUDA error"
    report = build_report("decoupled diloco", 2, samples, {0: 2.0, 1: 2.0}, rollback_steps=False, failures=[why])
    text = report.summary()
    assert report.failed and report.to_dict()["failed"] is True
    assert text.splitlines()[0] == f"decoupled diloco: run FAILED: {why}"
    assert "no island trained a step" in text and "global downtime 0.0s" not in text and "goodput 0" not in text


def _status(incarnation, seen_s_ago=0.0, **accepted):
    islands = {int(i[1:]): IslandStatus(live=True, world_size=1, steps=0, schedule_step=0, step_time_s=0.1, accepted=n,
                                        seen_s_ago=seen_s_ago) for i, n in accepted.items()}
    return SynchronizerStatus(shard=0, num_shards=1, incarnation=incarnation, layout_hash="h", outer_steps=0, run_step=0,
                              sync_every=1, num_fragments=1, min_quorum=1, bytes_in=0, bytes_out=0, checkpoint_failures=0,
                              last_checkpoint_error="", last_checkpoint_outer_steps=0, islands=islands)


def test_recovery_runs_from_the_kill_to_the_restarted_processes_first_merged_contribution():
    clock = RecoveryClock()
    clock.observe(_status("a", i1=40), now=10.0)
    clock.island_restarted(1, went_down=10.5, restarted=11.0)  # killed at 10.5, restarted at once
    # what the dead process sent just before the kill is merged after it: not a recovery
    clock.observe(_status("a", seen_s_ago=2.0, i1=41), now=12.0)
    clock.observe(_status("a", seen_s_ago=12.0, i1=42), now=22.0)
    assert clock.recoveries == [] and clock.unrecovered == [1]
    clock.observe(_status("a", seen_s_ago=0.1, i1=42), now=30.0)  # the restarted process joined (imports took 19 s)
    clock.observe(_status("a", seen_s_ago=0.1, i1=42), now=31.0)
    clock.observe(_status("a", seen_s_ago=0.1, i1=43), now=32.5)
    assert clock.recoveries == [22.0] and clock.unrecovered == []


def test_recovery_counts_from_zero_again_after_the_synchronizer_restarts():
    # the island restarts while the synchronizer is down; the new synchronizer counts from 0,
    # and 7 merged is a recovery even though the old incarnation had counted 40
    clock = RecoveryClock()
    clock.observe(_status("a", i1=40), now=10.0)
    clock.island_restarted(1, went_down=11.0, restarted=11.0)
    clock.observe(_status("a", seen_s_ago=0.1, i1=40), now=14.0)  # joined: baseline 40
    clock.observe(_status("b", seen_s_ago=0.1, i1=0), now=15.0)
    assert clock.recoveries == []
    clock.observe(_status("b", seen_s_ago=0.1, i1=7), now=16.0)
    assert clock.recoveries == [5.0] and clock.accepted == {1: 7}
