"""The launcher's island environments and start-up schedule (no processes started)."""

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.settings import config_with
from lightning_diloco.launch.environments import island_environment
from lightning_diloco.launch.options import RunOptions, add_run_arguments
from lightning_diloco.launch.run import Run
from lightning_diloco.launch.supervisor import UnitState


def _options(tmp_path, *argv):
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    return RunOptions.from_args(parser.parse_args(["--workdir", str(tmp_path), *argv]))


def _run(tmp_path, *argv):
    return Run(_options(tmp_path, *argv), ["true"])


def _island_environment(tmp_path, island, *argv):
    """What island ``island`` of a run with these flags is started with."""
    options = _options(tmp_path, *argv)
    return island_environment(options, island, tmp_path, options.synchronizer)


def test_the_flags_and_the_options_agree():
    """Every RunOptions field is a flag with the field's default; the token comes from the
    environment when no flag gives it."""
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    assert RunOptions.from_args(parser.parse_args([])) == RunOptions(token=os.environ.get("DILOCO_TOKEN") or None)
    options = RunOptions.from_args(parser.parse_args(["--islands=3", "--sync=--min-quorum=2", "--baseline=ddp"]))
    assert (options.islands, options.synchronizer_args, options.baseline) == (3, ["--min-quorum=2"], "ddp")
    with pytest.raises(ValueError, match="--islands=0"):
        RunOptions(islands=0)


def test_the_started_synchronizer_gets_the_run_config_as_a_file(tmp_path, monkeypatch):
    started = {}
    monkeypatch.setattr("lightning_diloco.launch.supervisor.Supervised.start", lambda self: started.setdefault(self.name, self.command))
    monkeypatch.setattr("lightning_diloco.transport.client.SynchronizerClient.__init__", lambda self, *a, **k: None)
    config = config_with({"min_quorum": 2, "apply": "mix"})
    run = Run(RunOptions(islands=2, workdir=str(tmp_path), run_config=config, synchronizer_args=["--status-port=0"]), ["true"])
    run.start()
    cmd = started["synchronizer"]
    path = cmd[cmd.index("--config") + 1]
    assert RunConfig.from_dict(json.loads(Path(path).read_text())) == config
    assert cmd[-1] == "--status-port=0"  # the caller's own arguments come last: they win


def test_islands_share_the_hosts_cores_when_the_user_set_no_thread_count(tmp_path, monkeypatch):
    """Left to Lightning, each one-process island would take every core: M x too many threads."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert _island_environment(tmp_path, 0, "--islands", "4", "--synchronizer", "127.0.0.1:1")["OMP_NUM_THREADS"] == "2"
    assert _island_environment(tmp_path, 3, "--islands", "16", "--synchronizer", "127.0.0.1:1")["OMP_NUM_THREADS"] == "1"


def test_a_thread_count_the_user_set_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _island_environment(tmp_path, 1, "--islands", "4", "--synchronizer", "127.0.0.1:1")["OMP_NUM_THREADS"] == "3"


def test_an_island_without_a_synchronizer_address_is_refused_by_name(tmp_path):
    """Only the DDP baseline starts islands with no synchronizer; a decoupled island started
    without one would have joined "None"."""
    with pytest.raises(ValueError, match="island 1 .* needs the synchronizer's address.*--synchronizer"):
        island_environment(RunOptions(islands=2), 1, tmp_path, None)
    assert "DILOCO_SYNCHRONIZER" not in island_environment(RunOptions(islands=2, baseline="ddp"), 0, tmp_path, None)


def test_staggered_islands_wait_their_turn(tmp_path, monkeypatch):
    started = []

    def start(self):
        self._move(UnitState.RUNNING)
        started.append(self.name)

    monkeypatch.setattr("lightning_diloco.launch.supervisor.Supervised.start", start)
    monkeypatch.setattr("lightning_diloco.transport.client.SynchronizerClient.__init__", lambda self, *a, **k: None)
    run = _run(tmp_path, "--islands", "3", "--stagger", "3", "--synchronizer", "127.0.0.1:1")
    run.start()
    assert started == ["island 0"]
    assert [(u.state, u.due - run.t0) for u in run.islands[1:]] == [(UnitState.WAITING, 3.0), (UnitState.WAITING, 6.0)]
    run._handle_exits(run.t0 + 3.5)
    assert started == ["island 0", "island 1"] and run.islands[1].restarts == 0  # a first start, not a restart


def test_an_island_the_synchronizer_refused_is_not_restarted_and_the_run_says_why(tmp_path, capsys):
    import sys

    from lightning_diloco.launch.run import run

    refuse = "print('island 0: the synchronizer at x refused it (layout_mismatch): another model'); raise SystemExit(78)"
    options = RunOptions(workdir=str(tmp_path), islands=2, synchronizer="127.0.0.1:1", max_restarts=5)
    assert run(options, [sys.executable, "-c", refuse]) == 1
    out = capsys.readouterr().out
    assert "restarted" not in out
    assert out.strip().splitlines()[-1].startswith("run failed: island") and "layout_mismatch" in out.strip().splitlines()[-1]


def test_a_restarted_island_without_a_checkpoint_is_told_it_trains_its_steps_again(tmp_path):
    from lightning_diloco.launch.run import without_checkpoint

    folder = tmp_path / "checkpoints-1"
    note = without_checkpoint("island 1", folder)
    assert note and "no checkpoint" in note and str(folder) in note and "examples/train_lm.py" in note
    folder.mkdir()
    assert without_checkpoint("island 1", folder) is not None  # an empty folder resumes nothing either
    (folder / "last.ckpt").write_bytes(b"x")
    assert without_checkpoint("island 1", folder) is None


def test_faults_and_resumes_do_not_wait_for_a_status_call_that_hangs(tmp_path, monkeypatch):
    """The launcher asks the synchronizer for its status on its own thread: while a call hangs (a
    synchronizer that is down or stuck takes the client's whole timeout), faults still fire on
    time and a paused island is still resumed."""
    import threading

    release = threading.Event()
    calls = []

    class HangingClient:
        def __init__(self, *args, **kwargs):
            pass

        def status(self):
            calls.append(time.monotonic())
            release.wait(60)
            raise ConnectionError("synchronizer down")

        def close(self):
            pass

    monkeypatch.setattr("lightning_diloco.transport.client.SynchronizerClient", HangingClient)
    options = RunOptions(workdir=str(tmp_path), islands=1, synchronizer="127.0.0.1:1", chaos="pause 0 at 0.2s for 0.3s")
    run = Run(options, ["sleep", "60"])
    run.start()
    loop = threading.Thread(target=run.loop, name="diloco-test-launch-loop")
    loop.start()
    try:
        island = run.islands[0]
        _wait_for(lambda: run.fired and island.state is UnitState.PAUSED, "the pause")
        _wait_for(lambda: island.state is UnitState.RUNNING, "the resume")
        assert len(calls) == 1 and not release.is_set()  # all while the first status call still hangs
    finally:
        release.set()
        run._stop.set()
        loop.join(60)
        run.shutdown()


def _wait_for(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def test_each_island_is_given_its_own_credential_not_the_run_token(tmp_path):
    from lightning_diloco.synchronizer.credentials import identify, island_credential

    for i in range(3):
        given = _island_environment(tmp_path, i, "--islands", "3", "--synchronizer", "127.0.0.1:1", "--token", "s3cret")["DILOCO_TOKEN"]
        assert given == island_credential("s3cret", i) and identify("s3cret", given).island == i


def test_a_python_that_cannot_import_the_package_is_refused_before_any_island_starts(tmp_path, capsys):
    """Otherwise every island crash-loops --max-restarts times before the run says anything useful."""
    import sys

    from lightning_diloco.launch.run import run

    bare = tmp_path / "python-bare"  # a Python without this package: isolated, no site-packages
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    options = RunOptions(workdir=str(tmp_path / "work"), islands=2, synchronizer="127.0.0.1:1")
    with pytest.raises(ValueError, match=r"python-bare\) cannot import lightning_diloco.*pip install lightning-diloco"):
        run(options, [str(bare), "train.py"])
    with pytest.raises(ValueError, match="cannot run the island command 'no-such-python3'"):
        run(options, ["no-such-python3", "train.py"])
    assert "[island" not in capsys.readouterr().out


def test_an_island_that_crashes_on_a_missing_module_is_not_restarted(tmp_path, capsys):
    from lightning_diloco.launch.run import run

    crash = "echo 'Traceback (most recent call last):'; echo \"ModuleNotFoundError: No module named 'transformers'\"; exit 1"
    options = RunOptions(workdir=str(tmp_path), islands=2, synchronizer="127.0.0.1:1", max_restarts=5)
    assert run(options, ["sh", "-c", crash]) == 1
    out = capsys.readouterr().out
    assert "restarted" not in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("run failed: island") and "No module named 'transformers'" in last


def test_an_island_that_fails_the_same_way_twice_before_its_first_step_is_not_restarted_again(tmp_path, capsys):
    """A ValueError in the user's set-up was restarted 5 times with backoff (114 s) before the
    run failed; now after one restart, saying why."""
    from lightning_diloco.launch.run import run

    bug = "echo 'Traceback (most recent call last):'; echo 'ValueError: lr must be positive'; exit 1"
    options = RunOptions(workdir=str(tmp_path), islands=1, synchronizer="127.0.0.1:1", max_restarts=5, restart_backoff=0.05)
    assert run(options, ["sh", "-c", bug]) == 1
    out = capsys.readouterr().out
    assert out.count("restarted island 0") == 1, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("run failed: island 0 failed the same way twice before its first training step"), last
    assert "exit 1: ValueError: lr must be positive" in last


def test_an_island_that_crashes_differently_each_time_keeps_its_restarts(tmp_path, capsys):
    from lightning_diloco.launch.run import run

    crash = "echo \"RuntimeError: lost device $$\"; exit 1"  # its pid: another message each time
    options = RunOptions(workdir=str(tmp_path), islands=1, synchronizer="127.0.0.1:1", max_restarts=2, restart_backoff=0.05)
    assert run(options, ["sh", "-c", crash]) == 1
    out = capsys.readouterr().out
    assert out.count("restarted island 0") == 2 and "used up its 2 restarts" in out, out


def test_an_island_that_ignores_its_devices_is_said_once(tmp_path, capsys):
    from lightning_diloco.core.protocol import IslandStatus, SynchronizerStatus

    island = IslandStatus(live=True, world_size=1, steps=0, schedule_step=0, step_time_s=0.1, accepted=0, seen_s_ago=0.0)
    status = SynchronizerStatus(shard=0, num_shards=1, incarnation="a", layout_hash="h", outer_steps=0, run_step=0,
                                sync_every=1, num_fragments=1, min_quorum=1, bytes_in=0, bytes_out=0, checkpoint_failures=0,
                                last_checkpoint_error="", last_checkpoint_outer_steps=0, islands={0: island})
    run = _run(tmp_path, "--devices-per-island", "2", "--synchronizer", "127.0.0.1:1")
    run._check_world_sizes(status)
    run._check_world_sizes(status)
    out = capsys.readouterr().out
    assert out.count("island 0 joined with 1 process(es), not --devices-per-island=2") == 1 and "DILOCO_DEVICES" in out
    assert _run(tmp_path, "--synchronizer", "127.0.0.1:1")._check_world_sizes(status) is None
    assert capsys.readouterr().out == ""


def test_the_report_file_is_named_and_replacing_an_earlier_one_is_said(tmp_path, capsys):
    """A second run with the same --report replaces the first's file: the launcher says where the
    report went and that it replaced one, rather than overwriting it silently."""
    import sys

    from lightning_diloco.launch.run import run

    report = tmp_path / "runs" / "report.json"
    options = RunOptions(workdir=str(tmp_path / "work"), islands=1, synchronizer="127.0.0.1:1", report=str(report))
    assert run(options, [sys.executable, "-c", "pass"]) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert first == f"[launcher] report written to {report}" and json.loads(report.read_text())["islands"]
    assert run(options, [sys.executable, "-c", "pass"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"[launcher] report written to {report}, replacing an earlier run's"


def test_an_island_script_that_is_not_there_is_refused_before_any_island_starts(tmp_path, monkeypatch, capsys):
    """Run from another folder, `-- python examples/train_lm.py` named no file: the islands used to
    crash and be restarted 5 times each (about 30 s) before the run failed."""
    import sys

    from lightning_diloco.launch.run import run

    monkeypatch.chdir(tmp_path)
    options = RunOptions(workdir=str(tmp_path / "work"), islands=2, synchronizer="127.0.0.1:1")
    with pytest.raises(ValueError, match=r"the island script 'examples/train_lm.py' does not exist in .*full path"):
        run(options, [sys.executable, "-u", "examples/train_lm.py", "--steps", "48"])
    assert "[island" not in capsys.readouterr().out
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "train_lm.py").write_text("")
    assert run(options, [sys.executable, "-u", "examples/train_lm.py", "--steps", "48"]) == 0  # there: it runs
    assert run(options, [sys.executable, "-W", "ignore", "-c", "pass"]) == 0  # no script to look for


def test_a_chaos_schedule_that_cannot_be_read_leaves_an_earlier_run_in_the_workdir_alone(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "synchronizer").mkdir()  # an earlier run's state
    with pytest.raises(ValueError, match="cannot read fault 'kil 1 at 3s'"):
        _run(work, "--chaos", "kil 1 at 3s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"] and (work / "synchronizer").is_dir()


def test_islands_leave_out_upstream_warnings_but_keep_the_users_own(tmp_path, monkeypatch):
    """Every island printed torch's pytree deprecation and Lightning's tips, M times a run; a
    warning of the user's code still shows, and a PYTHONWARNINGS the user set still wins."""
    import subprocess
    import sys

    from lightning_diloco.launch.environments import island_environment
    from lightning_diloco.launch.options import RunOptions

    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    env = island_environment(RunOptions(islands=2), 0, tmp_path, "127.0.0.1:1")
    script = ("import warnings\n"
              "warnings.warn('`isinstance(treespec, LeafSpec)` is deprecated', FutureWarning)\n"
              "warnings.warn('The number of training batches (16) is smaller than the logging interval')\n"
              "warnings.warn('my own warning')\n")
    shown = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60).stderr
    assert "my own warning" in shown and "LeafSpec" not in shown and "training batches" not in shown
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    env = island_environment(RunOptions(islands=2), 0, tmp_path, "127.0.0.1:1")
    shown = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60).stderr
    assert "LeafSpec" in shown
