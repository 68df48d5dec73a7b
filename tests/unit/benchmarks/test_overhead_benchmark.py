import pytest

from benchmarks import overhead

pytestmark = pytest.mark.slow


def test_overhead_benchmark_prints_the_step_time_ratio_of_both_island_sizes(capsys):
    results = overhead.main(["--steps", "12", "--warmup", "2", "--hidden", "64", "--layers", "1", "--vocab", "256",
                             "--seq", "16", "--batch", "2", "--repeats", "1", "--num-fragments", "8"])
    assert set(results) == {1, 2}
    for result in results.values():
        assert result["ratio"] > 0 and result["syncs_applied"] >= 1
    out = capsys.readouterr().out
    assert "step-time ratio diloco / plain (1 process(es))" in out
    assert "step-time ratio diloco / plain (2 process(es))" in out
