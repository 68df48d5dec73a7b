import os
import subprocess
import sys
import time

import pytest

from recipes.processes import run_tree


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone too
        return f.read().split(")")[-1].split()[0] == "Z"


def test_a_timed_out_benchmark_arm_is_stopped_with_the_processes_it_started(tmp_path):
    pidfile = tmp_path / "rank1.pid"
    rank1 = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    arm = (f"import pathlib, subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {rank1!r}]); "
           f"pathlib.Path({str(pidfile)!r}).write_text(str(p.pid)); time.sleep(600)")
    with pytest.raises(subprocess.TimeoutExpired):
        run_tree([sys.executable, "-c", arm], timeout=10)
    assert pidfile.exists(), "the arm did not start its rank within the timeout"
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "a rank that ignores SIGTERM outlived its arm"


def test_a_finished_run_returns_its_output_and_exit_code():
    done = run_tree([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], timeout=60, capture_output=True, text=True)
    assert (done.returncode, done.stdout.strip()) == (3, "hi")
