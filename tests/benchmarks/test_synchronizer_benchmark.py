from benchmarks import synchronizer


def test_synchronizer_benchmark_reports_throughput_against_one_learner(capsys):
    rows = synchronizer.main(["--learners", "1", "2", "--sizes", "20000", "--budget-mb", "0.05"])
    assert [r["learners"] for r in rows] == [1, 2]
    assert rows[0]["mb_per_s_vs_one"] == 1.0 and rows[1]["mb_per_s"] > 0
    assert rows[1]["round_latency_s"] > 0
    assert "MB/s vs M=1" in capsys.readouterr().out


def test_synchronizer_benchmark_prints_json_rows_against_plain_grpc(capsys):
    import json

    synchronizer.main(["--learners", "2", "--sizes", "20000", "--budget-mb", "0.05", "--plain", "--json"])
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert row["mb_per_s"] > 0 and row["plain_mb_per_s"] > 0 and row["vs_plain"] == row["mb_per_s"] / row["plain_mb_per_s"]
