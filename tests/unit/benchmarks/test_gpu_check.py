"""benchmarks/gpu.py: the GPU check's every part at toy size on the CPU (``--smoke``), so that the one
run it gets on a GPU takes no code path that no test has run."""

import json

import pytest
import torch

from benchmarks import gpu

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)  # a hang guard: about 3 minutes on a loaded 2-core machine
def test_the_smoke_run_goes_through_every_part_and_saves_each_figure(tmp_path, capsys, monkeypatch):
    # part (b) SIGKILLs an island: whatever it held in the temporary directory then stays (once, a
    # Python tempfile of its, tmp_m97jeyb), so its processes get one of this test's own
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    gpu.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert saved["device"] == "cpu" and saved["smoke"] is True
    for part in ("staging", "a", "b", "c"):
        assert "error" not in saved[part], saved[part]
    assert saved["staging"]["ok"]
    a = saved["a"]
    assert a["ratio"] > 0 and a["runs"]["diloco"][0]["syncs_applied"] > 0  # the island synced while measured
    b = saved["b"]
    assert b["restarts"]["1"] == 1 and b["rejoined"], b  # the killed island came back and contributed again
    assert all(steps == gpu.SIZES["smoke"]["b_steps"] for steps in b["final_steps"].values())
    assert all(merged > 0 for merged in b["accepted"].values())
    c = saved["c"]
    assert c["ddp"]["tokens"] == c["diloco"]["tokens"]  # equal tokens: M islands against one process of M x the batch
    assert 0 < c["ddp"]["eval_loss"] < 10 and 0 < c["diloco"]["eval_loss"] < 10
    out = capsys.readouterr().out
    assert "0. staging on cpu" in out and "(a)" in out and "(b)" in out and "gap" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check itself")
def test_without_a_gpu_it_says_to_run_the_smoke_version(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--parts", "staging"])
    assert "--smoke" in capsys.readouterr().err
