"""IslandShards over FSDP2 parameters in 2 real processes (gloo): gather whole on the leader, cut
the leader's whole value into every shard, writes seen by the next forward."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.learner.test_islands_multiprocess import _env

pytestmark = pytest.mark.slow


def test_fragments_move_between_whole_and_fsdp2_shards(tmp_path):
    script = Path(__file__).with_name("shards_script.py")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
                            env=_env(TMPDIR=str(tmp_path)),  # torchrun's own files go there
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert "rank 0 ok" in out and "rank 1 ok" in out
