import numpy as np
import pytest

from benchmarks import goodput_sim as g


def test_no_failures_means_full_goodput_for_every_method():
    a = g.Assumptions()
    empty = np.array([])
    assert g.data_parallel(empty, 1000, 3600.0, a) == pytest.approx(1.0, abs=0.02)  # only checkpoint stalls
    assert g.elastic_data_parallel(empty, 1000, 3600.0, a) == 1.0
    assert g.decoupled_diloco(empty, np.array([], dtype=int), 1000, 4, 3600.0, a, elastic=False) == 1.0


def test_a_failure_during_a_restart_starts_the_restart_again():
    kept, restarts = g.restarting_job(np.array([100.0, 150.0]), 1000.0, restart=300.0, lose=lambda run: 0.0)
    assert restarts == 1 and kept == pytest.approx(100.0 + (1000.0 - 450.0))


def test_one_failed_learner_leaves_the_others_training():
    a = g.Assumptions(restart=100.0, sync_window=0.0)
    times, slices = np.array([10.0]), np.array([0])
    goodput = g.decoupled_diloco(times, slices, 1024, 4, 1000.0, a, elastic=False)
    assert goodput == pytest.approx(1 - 100.0 / 1000.0 / 4)


def test_goodput_falls_with_scale_and_more_learners_help(capsys):
    rows, results = g.table([150_000, 1_200_000], g.Assumptions(days=1.0), seeds=1)
    assert rows[:2] == ["DP", "elastic DP"] and rows[-1] == "Decoupled DiLoCo M=16"
    small, big = results[150_000], results[1_200_000]
    assert big["DP"] < small["DP"] and big["Decoupled DiLoCo M=16"] > big["Decoupled DiLoCo M=2"] > big["DP"]
    assert g.main(["--chips", "150000", "--days", "0.5", "--seeds", "1"]) == 0
    assert "| Decoupled DiLoCo M=16 |" in capsys.readouterr().out
