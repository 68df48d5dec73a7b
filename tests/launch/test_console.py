"""What the launcher prints in progress mode: one line every few seconds, problems once, the rest to logs."""

import dataclasses

from lightning_diloco.launch.console import Console, progress_line
from lightning_diloco.launch.supervisor import Progress, read_progress, read_progress_line
from tests.launch.test_report import _status


def test_progress_mode_logs_every_line_and_shows_each_problem_once(tmp_path):
    shown = []
    console = Console(shown.append, tmp_path, progress_every=5.0)
    out0, out1 = console.output_of("island 0"), console.output_of("island 1")
    banner = "GPU available: False, used: False\n"
    warning = "2026-11-24 07:08:52,260 lightning_diloco.learner.end_of_run WARNING the round did not close\n"
    for out in (out0, out1):
        out(banner)
        out(warning.replace("07:08:52", "07:09:01") if out is out1 else warning)  # the same message, later
    out1("ModuleNotFoundError: No module named 'transformers'\n")
    console.close()
    assert shown == [f"[island 0] {warning}", "[island 1] ModuleNotFoundError: No module named 'transformers'\n"]
    assert (tmp_path / "island-0.log").read_text() == banner + warning
    assert (tmp_path / "island-1.log").read_text().count("\n") == 3


def test_by_default_every_line_is_printed_with_its_name(tmp_path):
    shown = []
    Console(shown.append, tmp_path, progress_every=0).output_of("synchronizer")("listening\n")
    assert shown == ["[synchronizer] listening\n"] and not list(tmp_path.iterdir())


def test_the_progress_line_says_steps_loss_and_outer_steps():
    status = dataclasses.replace(_status("a", i0=3, i1=4), outer_steps=41)
    both = {0: "training", 1: "training"}
    line = progress_line(35.2, {0: Progress(35, 120, 3.0), 1: Progress(37, 120, 3.5)}, both, status)
    assert line == "[progress] 35s, steps 35-37 of 120, train loss 3.250, outer steps 41, 2/2 islands training\n"
    assert "starting" in progress_line(3.0, {0: Progress(0), 1: Progress(0)}, {0: "starting", 1: "starting"}, None)


def test_the_progress_line_counts_an_island_that_is_down_or_restarting_as_not_training():
    """During an outage the line said 4/4 islands running: a restarted process counted while it
    imported and joined, and a killed one until its restart."""
    progress = {i: Progress(300, 800, 2.0) for i in range(4)}
    line = progress_line(60.0, progress, {0: "training", 1: "down", 2: "training", 3: "starting"}, None)
    assert line.endswith("2/4 islands training (island 1 down, island 3 starting)\n")


def test_an_island_is_training_once_its_current_process_wrote_progress(tmp_path):
    import os
    import sys
    import time

    from lightning_diloco.launch.supervisor import Supervised

    unit = Supervised("island 0", [sys.executable, "-c", "import time; time.sleep(60)"], make_env=lambda: dict(os.environ))
    path = tmp_path / "progress-0.txt"
    path.write_text("300 800 2.0")  # the killed process's last line
    os.utime(path, (time.time() - 5, time.time() - 5))
    unit.start()
    try:
        assert unit.activity(path) == "starting"
        path.write_text("301 800 2.0")
        assert unit.activity(path) == "training"
        unit.kill()
        unit.proc.wait(timeout=30)
        assert unit.activity(path) == "down"
    finally:
        if unit.alive:
            unit.proc.kill()
            unit.proc.wait(timeout=30)


def test_progress_files_carry_step_max_steps_and_loss_and_old_ones_still_read(tmp_path):
    path = tmp_path / "progress-0.txt"
    path.write_text(Progress(120, 800, 2.5).line())
    assert read_progress_line(path) == Progress(120, 800, 2.5) and read_progress(path) == 120
    path.write_text(Progress(3).line())  # no max_steps, no loss yet
    assert read_progress_line(path) == Progress(3, None, None)
    path.write_text("951")  # the step-only form
    assert read_progress_line(path) == Progress(951) and read_progress(tmp_path / "missing") == 0


def test_the_progress_file_callback_writes_what_the_launcher_reads(tmp_path):
    import lightning.pytorch as pl

    from lightning_diloco.launch.progress import ProgressFile
    from tests.learner.models import TinyRegressor, loader, regression_data

    trainer = pl.Trainer(max_steps=5, accelerator="cpu", callbacks=[ProgressFile(tmp_path / "progress-0.txt")], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyRegressor(), loader(regression_data()))
    progress = read_progress_line(tmp_path / "progress-0.txt")
    assert (progress.step, progress.max_steps) == (5, 5) and progress.loss is not None and progress.loss > 0
