"""Checkpoints know whose they are: another run's or another shard's checkpoint is
refused naming both, a summary without its data refuses to start, and a killed write's
temporary files are cleaned at start. A directory has one synchronizer at a time: a second is
refused at start, naming the first, until the first stops or dies."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.helpers import SPECS, FakeClock, contribution, initial_fragments, layout, run_bounded, run_config

CLI = [sys.executable, "-m", "lightning_diloco.cli"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(directory, *, run_id=None, shard=0, num_shards=1, rounds=1):
    """A synchronizer that merged ``rounds`` rounds of its first owned fragment, checkpointed and
    shut down (which leaves the directory to the next one)."""
    config = run_config(num_fragments=2)
    sync = Synchronizer(config, SynchronizerSettings(checkpoint_dir=directory, run_id=run_id, shard=shard, num_shards=num_shards, clock=FakeClock()))
    sync.join(0, 1, SPECS)
    p = shard
    sync.seed(0, p, get_codec("fp32").encode(initial_fragments(config)[p]))
    for r in range(rounds):
        sync.push(contribution(config, 0, p, torch.full((layout(config).fragment_numel(p),), 0.01), round=r, base_version=r, seq=r))
        sync.poll()
    sync.checkpoint()
    sync.shutdown()
    return sync


def test_another_runs_checkpoint_copied_in_is_refused_naming_both(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _run(a, run_id="run-a", rounds=1)
    _run(b, run_id="run-b", rounds=3)  # more outer steps: it would be the newest in a's folder
    for f in b.glob("synchronizer-*"):
        shutil.copy(f, a)
    with pytest.raises(ValueError) as err:
        Synchronizer(run_config(num_fragments=2), SynchronizerSettings(checkpoint_dir=a))
    assert "'run-a'" in str(err.value) and "'run-b'" in str(err.value)
    with pytest.raises(ValueError) as err:  # and a run id that is not the checkpoint's
        Synchronizer(run_config(num_fragments=2), SynchronizerSettings(checkpoint_dir=b, run_id="run-a"))
    assert "'run-a'" in str(err.value) and "'run-b'" in str(err.value)
    assert Synchronizer(run_config(num_fragments=2), SynchronizerSettings(checkpoint_dir=b)).directory.identity["run_id"] == "run-b"  # its own: resumed


def test_another_shards_checkpoint_is_refused_naming_both(tmp_path):
    _run(tmp_path, run_id="r", shard=0, num_shards=2)
    with pytest.raises(ValueError) as err:
        Synchronizer(run_config(num_fragments=2), SynchronizerSettings(checkpoint_dir=tmp_path, shard=1, num_shards=2))
    assert "shard 0 of 2" in str(err.value) and "shard 1 of 2" in str(err.value)


def test_a_summary_without_its_checkpoint_refuses_to_start(tmp_path):
    _run(tmp_path, rounds=2)
    for f in tmp_path.glob("synchronizer-*"):
        f.unlink()  # the pairs deleted, synchronizer.json kept
    with pytest.raises(ValueError) as err:
        Synchronizer(run_config(num_fragments=2), SynchronizerSettings(checkpoint_dir=tmp_path))
    assert "synchronizer.json" in str(err.value) and "lost their .pt" in str(err.value)


def test_a_killed_writes_temporary_files_are_removed_at_start(tmp_path):
    sync = _run(tmp_path, rounds=2)
    (tmp_path / ".synchronizer-000000000003.pt.abc123.tmp").write_bytes(b"\0" * 1000)
    (tmp_path / ".synchronizer.json.def456.tmp").write_text("{")
    restarted = Synchronizer(run_config(num_fragments=2), SynchronizerSettings(checkpoint_dir=tmp_path))
    assert restarted.run.state.outer_steps == sync.run.state.outer_steps
    assert not list(tmp_path.glob("*.tmp"))


def test_a_pinned_layout_refuses_another_first_joiner_and_checkpoint(tmp_path):
    """The first joiner no longer decides the run's model when the operator pinned it (
    a first joiner with a 1-tensor model locked every honest island out, also after restarts)."""
    from lightning_diloco.core.fragments import TensorSpec
    from lightning_diloco.synchronizer.requests import Refusal

    config = run_config(num_fragments=2)
    pinned = layout(config).hash
    sync = Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, layout_hash=pinned, clock=FakeClock()))
    with pytest.raises(Refusal) as err:
        sync.join(9, 1, [TensorSpec(name=n, shape=(4,), dtype="float32", role="dense") for n in "ab"])
    assert err.value.reason == "layout_mismatch" and pinned in str(err.value) and sync.run.state is None
    assert sync.join(0, 1, SPECS).layout_hash == pinned  # the honest island starts the run
    sync.seed(0, 0, get_codec("fp32").encode(initial_fragments(config)[0]))
    sync.checkpoint()
    sync.shutdown()
    with pytest.raises(ValueError, match="--layout-hash 0123"):
        Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, layout_hash="0123"))


def test_a_seed_no_model_starts_with_is_refused_and_an_honest_one_wins(tmp_path):
    from lightning_diloco.synchronizer.requests import Refusal

    config = run_config(num_fragments=2)
    sync = Synchronizer(config, SynchronizerSettings(clock=FakeClock()))
    sync.join(9, 1, SPECS)
    numel = layout(config).fragment_numel(0)
    with pytest.raises(Refusal) as err:
        sync.seed(9, 0, get_codec("fp32").encode(torch.full((numel,), 3e38)))
    assert err.value.reason == "bad_payload" and "3e+38" in str(err.value)
    assert sync.seed(9, 0, get_codec("fp32").encode(initial_fragments(config)[0]))  # still unseeded: this one wins


def test_a_second_shard_on_one_empty_directory_is_refused_naming_the_first(tmp_path):
    """Two shards given one --checkpoint-dir overwrote each other's checkpoints, found only at a
    restart: the second is refused at start, naming the first and the fix."""
    first = Synchronizer(run_config(num_fragments=2), SynchronizerSettings(checkpoint_dir=tmp_path, run_id="r", shard=0, num_shards=2))
    with pytest.raises(ValueError) as err:
        Synchronizer(run_config(num_fragments=2), SynchronizerSettings(checkpoint_dir=tmp_path, run_id="r", shard=1, num_shards=2))
    message = str(err.value)
    assert f"pid {os.getpid()}" in message and "shard 0 of 2" in message and "run 'r'" in message
    assert "its own --checkpoint-dir" in message
    assert not list(tmp_path.glob("synchronizer-*"))  # the refused one wrote nothing
    first.shutdown()  # a stopped synchronizer leaves the directory to the next
    second = Synchronizer(run_config(num_fragments=2), SynchronizerSettings(checkpoint_dir=tmp_path, run_id="r", shard=0, num_shards=2))
    second.shutdown()


def _start_cli(directory, log):
    """A synchronizer process on ``directory``, once it listens (bounded: it fails the test after
    120 s); its output goes to ``log``."""
    with log.open("w") as out:
        proc = subprocess.Popen([*CLI, "synchronizer", "--port", "0", "--checkpoint-dir", str(directory)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, env=ENV)
    deadline = time.monotonic() + 120
    while "synchronizer listening on" not in log.read_text():
        assert proc.poll() is None, f"the synchronizer exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the synchronizer did not start within 120 s:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)
    return proc


def _kill(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.timeout(400)
def test_a_second_synchronizer_process_is_refused_until_the_first_is_killed(tmp_path):
    """The lock is the kernel's: a SIGKILLed synchronizer leaves none behind, and its restart
    (a new process on the same directory) starts without anyone removing a file."""
    directory = tmp_path / "ckpt"
    first = _start_cli(directory, tmp_path / "first.log")
    try:
        refused = run_bounded([*CLI, "synchronizer", "--port", "0", "--checkpoint-dir", str(directory),
                               "--shard", "1", "--num-shards", "2"], timeout=120, env=ENV)
        assert refused.returncode == 2, refused.stdout
        assert f"is in use by another synchronizer (pid {first.pid} on host" in refused.stdout
        assert "shard 0 of 1" in refused.stdout and "its own --checkpoint-dir" in refused.stdout
    finally:
        _kill(first)
    restarted = _start_cli(directory, tmp_path / "restarted.log")
    try:
        assert restarted.poll() is None
    finally:
        _kill(restarted)
