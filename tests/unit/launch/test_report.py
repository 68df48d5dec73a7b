"""Goodput and downtime from sampled progress, by hand-computed examples."""

import pytest

from lightning_diloco.launch.report import Sample, build_report, downtime, useful_time


def test_useful_time_credits_every_advancing_interval():
    assert useful_time([(0, 0), (1, 10), (2, 20), (3, 20), (4, 30)]) == 3.0


def test_rolled_back_steps_are_not_useful():
    # reached step 30 by t=3, crashed, restarted from the checkpoint at step 10 at t=5, then 10 -> 40
    series = [(0, 0), (1, 10), (2, 20), (3, 30), (5, 10), (6, 20), (7, 30), (8, 40)]
    # kept: 0->10 (1 s), then 10->20, 20->30, 30->40 after the restart (3 s); 10->20, 20->30 before it are lost
    assert useful_time(series) == 4.0


def _samples(progress, alive=(0, 1)):
    return [Sample(float(t), g, {0: t, 1: t}, set(alive)) for t, g in enumerate(progress)]


def test_downtime_counts_stalls_after_the_first_progress_only():
    samples = _samples([0, 0, 0, 1, 2, 2, 2, 3, 3])
    total, longest = downtime(samples)
    assert total == 3.0 and longest == 2.0  # t 4->6 (2 s) and t 7->8 (1 s); start-up 0->3 is not downtime


def test_no_downtime_while_no_island_is_alive():
    samples = [Sample(0.0, 1, {}, {0}), Sample(1.0, 2, {}, {0}), Sample(2.0, 2, {}, set()), Sample(3.0, 2, {}, set())]
    assert downtime(samples) == (1.0, 1.0)  # only 1->2, when island 0 was still alive at its start


def test_goodput_is_useful_over_allocated_island_time():
    samples = [Sample(float(t), t, {0: t, 1: min(t, 2)}, {0, 1}) for t in range(5)]  # island 1 stalls after t=2
    report = build_report("x", 2, samples, {0: 4.0, 1: 4.0}, rollback_steps=False)
    assert report.useful_s == {0: 4.0, 1: 2.0}
    assert report.goodput == pytest.approx(6.0 / 8.0)
    assert "goodput 75.0%" in report.summary()
