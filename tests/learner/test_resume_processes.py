"""Resuming in a new process as a user does, for a model of fewer tensors than the default
fragment count: the synchronizer lowered it on its own in the first run, and the resumed run
takes it again (it was refused with layout_mismatch before: "num_fragments=24 exceeds the
model's 4 trainable tensors")."""

import sys
from pathlib import Path

import pytest

from tests.helpers import run_bounded

SCRIPT = Path(__file__).with_name("resume_script.py")


@pytest.mark.parametrize("loop", ["trainer", "fabric"])
def test_a_killed_island_of_a_small_model_resumes_with_the_fragment_count_its_run_chose(tmp_path, loop):
    first = run_bounded([sys.executable, str(SCRIPT), loop, str(tmp_path), "48", "--kill-at", "28"], timeout=150)
    assert first.returncode == 9, first.stdout[-3000:]  # killed at step 28, 4 steps after its last checkpoint
    resumed = run_bounded([sys.executable, str(SCRIPT), loop, str(tmp_path), "48", "--resume"], timeout=150)
    out = resumed.stdout
    assert resumed.returncode == 0, out[-3000:]
    assert "global_step 48" in out and "starts at its step 24" in out, out[-3000:]
    assert "P=4 H=24" in out and "layout_mismatch" not in out, out[-3000:]
    assert "differ" not in out, out[-3000:]  # no word of settings nobody gave
