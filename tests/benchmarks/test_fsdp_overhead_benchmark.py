import pytest

from benchmarks import fsdp_overhead

pytestmark = pytest.mark.slow


def test_fsdp_overhead_benchmark_prints_the_ratio_and_the_island_memory(capsys):
    result = fsdp_overhead.main(["--steps", "12", "--warmup", "2", "--hidden", "64", "--layers", "2", "--vocab", "256",
                                 "--seq", "16", "--batch", "2", "--repeats", "1", "--num-fragments", "8"])
    assert result["ratio"] > 0 and len(result["diloco_peak_rss_mb"]) == 2
    # each rank keeps its half of the bases; one fragment is at most a few tensors of the model
    assert result["bases_mb"] == pytest.approx(result["model_mb"] / 2, rel=0.05)
    assert result["largest_fragment_mb"] < result["model_mb"] / 2
    assert "step-time ratio island / plain" in capsys.readouterr().out
