import pytest

from benchmarks import chaos

pytestmark = pytest.mark.slow


def test_chaos_benchmark_prints_both_goodputs_and_the_ratio(capsys):
    result = chaos.main(["--islands", "2", "--steps", "60", "--step-seconds", "0.02", "--schedule", "kill 1 at step 20",
                         "--checkpoint-every", "10"])
    assert 0 < result["diloco_goodput"] <= 1 and 0 < result["ddp_goodput"] <= 1
    assert len(result["faults"]) == 1 and len(result["ddp_faults"]) == 1
    out = capsys.readouterr().out
    assert "goodput ratio diloco / ddp" in out and "ddp checkpoint-restart" in out
