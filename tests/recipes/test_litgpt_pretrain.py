"""The LitGPT recipe end to end at toy size: a LitGPT model from a ``litgpt.Config`` trained by real
island processes against a real synchronizer, and by a real 2-rank Fabric DDP job, on the text
recipes' data; and its refusal of a model it cannot build."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from recipes import litgpt_pretrain

STEPS = 40


@pytest.mark.slow
def test_litgpt_islands_learn_at_ddps_tokens_and_the_summary_says_how_far_apart(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "recipes.litgpt_pretrain", "--islands", "2", "--steps", str(STEPS),
                           "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    loss = result["eval_loss"]
    # byte tokens: about ln 256 = 5.5 untrained; 40 steps bring both arms well below it
    assert 5 < loss["untrained"] < 6.5
    assert loss["islands"] < loss["untrained"] - 1.5 and loss["ddp"] < loss["untrained"] - 1.5
    assert result["gap"] == pytest.approx(loss["islands"] / loss["ddp"] - 1)
    # equal tokens, counted by the processes that trained on them: 2 x 40 batches of 16 x 64
    assert result["tokens"] == {"islands": 2 * STEPS * 16 * 64, "ddp": 2 * STEPS * 16 * 64}
    assert result["step_time_ratio"] > 0 and result["bytes_across_islands"] > 0
    assert result["rounds_health"]["contributions_per_outer_step"] >= 1 and result["params"] > 100_000
    assert "against DDP's" in done.stdout and "step time: island" in done.stdout and "rounds:" in done.stdout


def test_a_width_litgpt_cannot_split_into_heads_is_refused_by_name():
    with pytest.raises(SystemExit, match="--n-embd must be a positive multiple of 32"):
        litgpt_pretrain.litgpt_config(2, 72)
