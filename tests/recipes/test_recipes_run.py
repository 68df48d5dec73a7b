"""Each recipe runs for a few steps end to end: real island processes, a real synchronizer (or a
real DDP job), real data from the packages, and the summary files compare.py builds on."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from recipes import compare
from recipes.data import FASHION_MNIST_DIR

pytestmark = pytest.mark.slow
TINY = ["--steps", "8", "--eval-every", "4", "--eval-batches", "1", "--final-eval-batches", "2"]


def _run(module, tmp_path, *argv):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", module, *argv, *TINY, "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "result.json").read_text()), out, done.stdout


def test_moe_recipe_two_islands_write_the_summary_curves_and_logs(tmp_path):
    result, out, stdout = _run("recipes.text_lm", tmp_path, "--preset", "cpu-tiny-moe", "--islands", "2", "--batch", "4")
    assert result["strategy"] == "decoupled_diloco" and result["steps"] == 8 and len(result["islands_results"]) == 2
    assert result["tokens"] == 2 * 8 * 4 * 64 and 0 < result["final"]["eval_loss"] < 6 and result["final"]["perplexity"] > 1
    assert result["outer_steps"] >= 1 and result["bytes_across"] > 0
    rows = list(csv.DictReader(open(out / "curve-island0.csv")))
    assert [int(r["step"]) for r in rows] == [4, 8]
    assert list((out / "logs").glob("island0/*/metrics.csv")), "the CSV logger always logs"
    assert "outer steps" in stdout and "bytes across islands" in stdout
    # a picture of the global model's eval curve, its path printed
    assert result["plot"] == str(out / "eval_loss-curve.png") and (out / "eval_loss-curve.png").stat().st_size > 1000
    assert f"the eval curve {out / 'eval_loss-curve.png'}" in stdout
    # the rounds' health is said beside the loss: every contribution merged, at least one step per fragment
    health = result["rounds_health"]
    assert health["contributions_per_outer_step"] >= 1 and health["outer_steps_per_fragment_per_h"] > 0
    assert 0 <= health["late"] <= 1 and "outer steps per fragment per H" in stdout
    # islands that overlap the sync (tau = 2) never wait on the network; the hook's own work is all of its time
    assert health["wait_s"] == 0 and 0 < health["hook"] < 1 and "waited on the network 0.0 s" in stdout
    report = json.loads((out / "run-report.json").read_text())  # the launcher's report says the rounds' part too
    assert report["rounds"]["contributions_per_outer_step"] == health["contributions_per_outer_step"]
    assert stdout.count("outer steps per fragment per H") >= 2  # the run report's line and the summary's
    # one progress display, not each island's Lightning banners: those are in the islands' logs
    assert "[progress]" in stdout and "GPU available" not in stdout
    assert "GPU available" in (out / "run" / "island-0.log").read_text()


def test_text_recipe_trains_fsdp2_islands_of_two_processes(tmp_path):
    """HF Llama sharded per decoder layer (configure_model, fully_shard) inside 2 islands of 2."""
    result, out, stdout = _run("recipes.text_lm", tmp_path, "--strategy", "decoupled_diloco_fsdp", "--islands", "2",
                               "--devices", "2", "--batch", "4", "--verbose")  # every island's own lines
    assert result["strategy"] == "decoupled_diloco_fsdp" and result["steps"] == 8
    assert result["tokens"] == 2 * 2 * 8 * 4 * 64 and 0 < result["final"]["eval_loss"] < 6
    assert result["outer_steps"] >= 1 and "island 0 of 2 (2 process(es))" in stdout
    unit = json.loads((out / "result-island0.json").read_text())
    assert unit["params_on_rank0"] < 0.6 * unit["params"]  # half of every tensor, rounded up per tensor


def test_a_killed_fsdp2_island_resumes_from_its_checkpoint_while_the_other_goes_on(tmp_path):
    """--chaos: island 1 (2 FSDP2 ranks) is SIGKILLed at step 12, restarted by the launcher, resumes
    from its last distributed checkpoint and finishes; island 0 makes outer steps meanwhile."""
    import re

    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "recipes.text_lm", "--strategy", "decoupled_diloco_fsdp", "--islands", "2",
                           "--devices", "2", "--batch", "4", "--steps", "40", "--eval-every", "20", "--eval-batches", "1",
                           "--final-eval-batches", "2", "--chaos", "kill 1 at step 12", "--verbose", "--out", str(out)],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "run-report.json").read_text())
    assert report["restarts"] == {"0": 0, "1": 1} and report["final_steps"] == {"0": 40, "1": 40}
    assert "[island 1] Restored all states from the checkpoint" in done.stdout + done.stderr  # Lightning's word
    killed_at = float(re.search(r"fired at ([0-9.]+)s", report["faults"][0]).group(1))
    back_at = killed_at + report["recoveries_s"][0]
    during = [progress for t, progress in report["global_series"] if killed_at <= t <= back_at]
    assert during and during[-1] > during[0], "no outer step while island 1 was down"


@pytest.mark.skipif(not FASHION_MNIST_DIR.exists(), reason="Debian's dataset-fashion-mnist is not installed")
def test_vision_recipe_reports_accuracy(tmp_path):
    result, _, _ = _run("recipes.vision", tmp_path, "--preset", "cpu-tiny-cnn", "--islands", "2", "--batch", "8")
    assert 0.0 <= result["final"]["accuracy"] <= 1.0 and result["tokens"] == 2 * 8 * 8


def test_compare_runs_ddp_and_diloco_and_writes_the_table_and_plots(tmp_path, capsys):
    out = tmp_path / "cmp"
    compare.main(["--recipe", "text_lm", "--islands", "2", "--steps", "6", "--out", str(out), "--",
                  "--batch", "4", "--eval-every", "3", "--eval-batches", "1", "--final-eval-batches", "1"])
    table = (out / "results.md").read_text()
    assert "| DDP, 2 processes |" in table and "| Decoupled DiLoCo, 2 islands (preset) |" in table
    assert (out / "eval_loss-vs-tokens.png").stat().st_size > 1000 and (out / "eval_loss-vs-wall_s.png").exists()
    ddp, diloco = json.loads((out / "results.json").read_text())
    assert ddp["strategy"] == "ddp" and ddp["bytes_across_how"].startswith("computed")
    assert diloco["strategy"] == "decoupled_diloco" and diloco["tokens"] == ddp["tokens"] == 2 * 6 * 4 * 64
    assert diloco["bytes_across"] < ddp["bytes_across"]


def test_a_second_run_into_the_same_folder_starts_fresh_and_resume_continues(tmp_path):
    """The README's two commands in a row: the second must not continue the first (its
    synchronizer checkpoint and progress files) unless asked to with --resume."""
    two = ["--islands", "2", "--batch", "4", "--verbose"]  # every island line: what step each started at
    _run("recipes.text_lm", tmp_path, *two)
    _, out, stdout = _run("recipes.text_lm", tmp_path, *two, "--chaos", "kill 1 at step 6")
    assert "held an earlier run: moved it to" in stdout and len(list(tmp_path.glob("out.prev-*"))) == 1
    assert "the run's clock, which schedules the fragments, is at 0)" in stdout  # not at the earlier run's last step
    assert "(fired at 0." not in stdout  # the kill waited for this run's island 1 to reach step 6
    _, _, stdout = _run("recipes.text_lm", tmp_path, *two, "--resume")
    assert "continuing the run in" in stdout and "the run's clock, which schedules the fragments, is at 0)" not in stdout
    assert len(list(tmp_path.glob("out.prev-*"))) == 1
