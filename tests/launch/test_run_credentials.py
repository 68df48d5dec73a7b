"""`lightning-diloco run --token`: each island is started with its own credential and
trains; the launcher reads Status with the run token (real processes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import run_bounded

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_islands_started_with_their_own_credentials_have_their_work_merged(tmp_path):
    report_path = tmp_path / "report.json"
    cmd = [
        sys.executable, "-m", "lightning_diloco.cli", "run", "--islands", "2", "--workdir", str(tmp_path / "run"),
        "--report", str(report_path), "--token", "run-secret",
        "--sync=--num-fragments=2", "--sync=--sync-every=4",
        "--", sys.executable, str(ROOT / "examples" / "train_lm.py"), "--steps", "80", "--step-seconds", "0.02",
        "--hidden", "32", "--layers", "1",
    ]
    done = run_bounded(cmd, timeout=360, cwd=ROOT)  # ~25 s on an idle 2-core machine
    assert done.returncode == 0, done.stdout[-4000:]
    report = json.loads(report_path.read_text())
    assert all(report["accepted"][str(i)] > 0 for i in range(2)), done.stdout[-4000:]
    assert "unauthenticated" not in done.stdout
