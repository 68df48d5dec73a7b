import pytest

from benchmarks import overhead

pytestmark = pytest.mark.slow


def test_overhead_benchmark_prints_the_step_time_ratio(capsys):
    result = overhead.main(["--steps", "12", "--warmup", "2", "--hidden", "64", "--layers", "1", "--vocab", "256",
                            "--seq", "16", "--batch", "2", "--repeats", "1", "--num-fragments", "8"])
    assert result["ratio"] > 0 and result["syncs_applied"] >= 1
    assert "step-time ratio diloco / plain" in capsys.readouterr().out
