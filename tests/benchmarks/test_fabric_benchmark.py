import pytest

from benchmarks import fabric

pytestmark = pytest.mark.slow


def test_fabric_benchmark_prints_the_eval_loss_of_islands_and_ddp_and_the_step_time_ratio(capsys):
    results = fabric.main(["--seeds", "0", "--steps", "12", "--repeats", "1", "--timing-steps", "14"])
    losses = results["eval_loss"][0]
    assert 0 < losses["islands"] < 6 and 0 < losses["ddp"] < 6  # byte tokens: ln 256 = 5.5 untrained
    assert results["ratio"] > 0 and len(results["step_s"]["plain"]) == 1
    out = capsys.readouterr().out
    assert "seed 0: eval loss islands" in out and "step time: plain Fabric" in out
