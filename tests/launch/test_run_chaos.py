"""`lightning-diloco run` under a fault schedule: the run never stops (real processes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import run_bounded

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_three_islands_survive_kills_a_pause_and_a_synchronizer_restart(tmp_path):
    report_path = tmp_path / "report.json"
    schedule = "kill 1 at step 60; kill 1 at step 120; pause 2 at 28s for 4s; kill-synchronizer at 34s"
    cmd = [
        sys.executable, "-m", "lightning_diloco.cli", "run", "--islands", "3", "--workdir", str(tmp_path / "run"),
        "--report", str(report_path), "--chaos", schedule, "--restart-backoff", "0.5",
        "--sync=--num-fragments=4", "--sync=--sync-every=4", "--sync=--overlap-steps=1",
        "--", sys.executable, str(ROOT / "examples" / "train_lm.py"), "--steps", "600", "--step-seconds", "0.05",
        "--hidden", "32", "--layers", "1",
    ]
    done = run_bounded(cmd, timeout=540, cwd=ROOT)  # ~100 s on an idle 2-core machine, 250 s on a loaded one
    assert done.returncode == 0, done.stdout[-4000:]
    report = json.loads(report_path.read_text())
    log = done.stdout[-6000:]  # the launcher's and the islands' output, for a failure's message

    assert len(report["faults"]) == 4, report["faults"]
    # island 1 restarted for its two kills only. CI once read 3 here (output not kept); the likely
    # cause, a restarted island's join giving up after ~10-20 s of retries while the synchronizer
    # was restarting, is gone: a starting island now waits for the synchronizer (join_wait)
    assert report["restarts"] == {"0": 0, "1": 2, "2": 0}, log
    # the killed island came back and its contributions were accepted again, both times (also when
    # its second kill and the synchronizer's fall together: CI once saw that read 1)
    assert len(report["recoveries_s"]) == 2, log
    # the global model never stopped moving, except while the synchronizer itself restarted: the
    # report counts stretches of over a second without an outer step. Two cores run three islands,
    # their restarts and the synchronizer; a restarted island importing torch starves the others
    # (2.4 s in all on a loaded machine; 5.6 s when CI ran beside another test suite). The bound is
    # a share of the run's own wall time, so load that slows everything moves both sides; the
    # DDP baseline under the same faults loses about a quarter of its run (~26 s of ~100 s)
    assert report["downtime_outside_synchronizer_restarts_s"] <= 0.1 * report["training_s"], (report["training_s"], report["global_series"], log)
    # no outer step was lost: global progress never goes back, across the synchronizer's restart too
    # (a fragment waiting for an island to give back its last version counts it: CI once saw a drop
    # here, read while one waited). A failure names the drops and the synchronizer's recovery lines
    series = report["global_series"]
    drops = [(a, b) for a, b in zip(series, series[1:]) if b[1] < a[1]]
    recovery = [line for line in done.stdout.splitlines() if any(k in line for k in ("published but", "taken back", "LOST"))]
    assert not drops, (drops, recovery)
    # the paused island was not waited for, and caught up: it finished, and contributions were
    # accepted from it after the pause (the synchronizer counts per incarnation: its restart at
    # 34 s came after the pause, so every one counted here is from after the pause)
    # (600 steps: island 2 must still be training well after the synchronizer's restart at 34 s;
    # with 400 a fast run finished it first and this count was 0)
    assert report["final_steps"]["2"] == 600 and report["accepted"]["2"] >= 10
    assert "final val_loss" in done.stdout
