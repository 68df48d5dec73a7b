import json

import numpy as np
import pytest

from benchmarks import goodput_sim as g

# Decoupled DiLoCo (arXiv 2604.21428), Table 1: goodput in percent, MTBI 1 year per chip.
PAPER_TABLE_1 = {
    "dp": [72, 57, 38, 27, 18],
    "dp_elastic": [88, 80, 69, 58, 40],
    "2": [94, 88, 80, 70, 54],
    "4": [96, 93, 89, 82, 73],
    "8": [98, 96, 94, 88, 80],
    "16": [99, 98, 96, 93, 86],
}
PAPER_CHIPS = ["150000", "300000", "600000", "1200000", "2400000"]


def test_no_failures_means_full_goodput_for_every_method():
    a = g.Assumptions()
    empty = np.array([])
    assert g.data_parallel(empty, 1000, 3600.0, a) == pytest.approx(1.0, abs=0.02)  # only checkpoint stalls
    assert g.elastic_data_parallel(empty, 1000, 3600.0, a) == 1.0
    assert g.decoupled_diloco(empty, np.array([], dtype=int), 1000, 4, 3600.0, a, elastic=False) == 1.0


def test_a_failure_during_a_restart_starts_the_restart_again():
    kept, restarts = g.restarting_job(np.array([100.0, 150.0]), 1000.0, restart=300.0, lose=lambda run: 0.0)
    assert restarts == 1 and kept == pytest.approx(100.0 + (1000.0 - 450.0))


def test_an_absorbed_failure_during_a_restart_costs_nothing_more():
    kept, restarts = g.restarting_job(np.array([100.0, 150.0]), 1000.0, restart=300.0, lose=lambda run: 0.0,
                                      absorb=True)
    assert restarts == 1 and kept == pytest.approx(100.0 + (1000.0 - 400.0))


def test_an_absorbed_failure_during_a_rescale_does_not_extend_the_pause():
    a = g.Assumptions(slice=1, rescale=100.0, repair=0.0)
    times = np.array([100.0, 150.0])
    assert g.elastic_data_parallel(times, 10, 1000.0, a) == pytest.approx((1000.0 - 150.0) / 1000.0)
    absorbing = g.Assumptions(slice=1, rescale=100.0, repair=0.0, absorb=True)
    assert g.elastic_data_parallel(times, 10, 1000.0, absorbing) == pytest.approx((1000.0 - 100.0) / 1000.0)


def test_a_dp_failure_loses_the_step_in_flight_when_checkpoints_are_free():
    a = g.Assumptions(restart=10.0, checkpoint_cost=0.0, step_time=5.0)
    goodput = g.data_parallel(np.array([103.0]), 1000, 1000.0, a)
    assert goodput == pytest.approx((1000.0 - 10.0 - 3.0) / 1000.0)


def test_one_failed_learner_leaves_the_others_training():
    a = g.Assumptions(restart=100.0, sync_window=0.0)
    times, slices = np.array([10.0]), np.array([0])
    goodput = g.decoupled_diloco(times, slices, 1024, 4, 1000.0, a, elastic=False)
    assert goodput == pytest.approx(1 - 100.0 / 1000.0 / 4)


def test_goodput_falls_with_scale_and_more_learners_help(capsys):
    rows = g.table([150_000, 1_200_000], g.Assumptions(days=1.0), seeds=1)
    assert list(rows) == ["dp", "dp_elastic", "2", "4", "8", "16"]
    assert rows["dp"][1_200_000] < rows["dp"][150_000]
    assert rows["16"][1_200_000] > rows["2"][1_200_000] > rows["dp"][1_200_000]
    assert g.main(["--chips", "150000", "--days", "0.5", "--seeds", "1"]) == 0
    assert "| Decoupled DiLoCo M=16 |" in capsys.readouterr().out


def test_paper_assumptions_reproduce_table_1_within_5_points(capsys):
    """Every cell of the paper's Table 1 within 5 points, from the documented paper set."""
    assert g.main(["--assumptions", "paper", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    misses = {(name, chips): (rows[name][chips], paper)
              for name, expected in PAPER_TABLE_1.items()
              for chips, paper in zip(PAPER_CHIPS, expected) if abs(rows[name][chips] - paper) > 5}
    assert not misses, f"(row, chips): (simulated, paper) more than 5 points apart: {misses}"


def test_json_has_one_row_per_method_keyed_by_chips_in_percent(capsys):
    assert g.main(["--json", "--days", "0.2", "--seeds", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["rows"]
    assert list(out["rows"]) == ["dp", "dp_elastic", "2", "4", "8", "16"]
    for row in out["rows"].values():
        assert list(row) == PAPER_CHIPS
        assert all(isinstance(v, float) and 0.0 <= v <= 100.0 and round(v, 1) == v for v in row.values())
    assert out["rows"]["16"]["1200000"] > 50.0 > out["rows"]["dp"]["1200000"]  # percent, not a fraction


def test_a_bad_assumption_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        g.main(["--step-time", "0"])
    assert "step_time must be > 0, got 0.0: pass a positive --step-time" in capsys.readouterr().err
