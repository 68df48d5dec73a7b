import pytest

from benchmarks import rounds

pytestmark = pytest.mark.slow


@pytest.mark.timeout(400)
def test_rounds_benchmark_reports_quality_against_ddp_and_the_rounds_health(tmp_path, capsys):
    summary = rounds.main(["--seeds", "0", "--steps", "12", "--islands", "2", "--only", "k1", "--out", str(tmp_path),
                           "--timeout", "300", "--recipe-arg=--eval-every=6", "--recipe-arg=--eval-batches=1",
                           "--recipe-arg=--final-eval-batches=2", "--recipe-arg=--batch=4"])
    assert set(summary) == {"ddp", "k1"} and summary["ddp"]["vs_ddp"] == 0.0
    k1 = summary["k1"]
    assert 0 < k1["eval_loss_mean"] < 10 and k1["outer_steps_per_fragment_per_h"] > 0
    assert 0 <= k1["skipped_share"] <= 1 and k1["longest_stall_s"] >= 0
    out = capsys.readouterr().out
    assert "vs DDP" in out and "outer/P/H" in out


def test_each_arm_names_its_quorum_rule_and_the_kill_scales_with_the_run():
    assert rounds.arm_flags("sync", 4, 800)[:2] == ["--min-quorum=4", "--apply=overwrite"]
    assert rounds.arm_flags("k1-mix", 4, 800)[:2] == ["--min-quorum=1", "--apply=mix"]
    assert rounds.arm_flags("ddp", 4, 800) == ["--strategy=ddp"]
    assert rounds.arm_flags("k1-mix-int4-down", 4, 800)[-1] == "--downlink-codec=int4"
    assert rounds.arm_flags("k1-kill", 4, 800)[-1] == "--chaos=kill 2 at step 300 for 20s; kill 3 at step 300 for 20s"
    assert "step 75 " in rounds.arm_flags("k1-kill", 4, 200)[-1]
