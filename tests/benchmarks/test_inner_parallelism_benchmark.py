import pytest

from benchmarks import inner_parallelism

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_inner_parallelism_benchmark_compares_ddp_and_fsdp2_islands_of_two_processes(tmp_path, capsys):
    summary = inner_parallelism.main(["--seeds", "0", "--steps", "12", "--out", str(tmp_path), "--timeout", "500"])
    for arm in ("ddp-islands", "fsdp2-islands"):
        assert 0 < summary[arm]["eval_loss_mean"] < 10 and len(summary[arm]["losses"]) == 1
    assert abs(summary["fsdp2_vs_ddp"]) < 1.0
    out = capsys.readouterr().out
    assert "FSDP2 islands vs DDP islands" in out and "aim within 1%" in out
