"""Checkpoint files: checksummed, the last few kept, corrupt ones skipped by name, no silent fresh start."""

import json
import os

import pytest
import torch

from lightning_diloco.core.checkpoints import KEEP, check_writable
from lightning_diloco.core.state import SynchronizerState
from tests.core.test_state import _advance, _state


def _saved(tmp_path, rounds=3):
    """A state saved after each of ``rounds`` rounds; returns the .pt paths, oldest first."""
    state = _state()
    paths = []
    for _ in range(rounds):
        _advance(state, 1)
        paths.append(state.save(tmp_path))
    return state, paths


def test_only_the_newest_few_are_kept(tmp_path):
    _, paths = _saved(tmp_path, rounds=KEEP + 2)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == [p.name for p in paths[-KEEP:]]
    assert sorted(p.name for p in tmp_path.glob("synchronizer-*.json")) == [p.with_suffix(".json").name for p in paths[-KEEP:]]


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "nan"])
def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(tmp_path, damage, caplog):
    state, paths = _saved(tmp_path)
    newest = paths[-1]
    data = bytearray(newest.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0xFF
        newest.write_bytes(bytes(data))
    elif damage == "truncated":
        newest.write_bytes(bytes(data[: len(data) // 3]))
    else:  # a NaN written with a valid checksum: only the finiteness check can catch it
        bad = state.state_dict()
        bad["fragments"][0]["history"][bad["fragments"][0]["version"]][0] = float("nan")
        import hashlib
        import io

        buffer = io.BytesIO()
        torch.save(bad, buffer)
        newest.write_bytes(buffer.getvalue())
        summary = json.loads(newest.with_suffix(".json").read_text())
        summary["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
        newest.with_suffix(".json").write_text(json.dumps(summary))
    loaded = SynchronizerState.load(tmp_path)
    assert loaded.outer_steps == 6  # the second of three saves (3 fragments a round)
    assert str(newest) in caplog.text  # reported by path


def test_no_valid_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    _, paths = _saved(tmp_path, rounds=1)
    paths[0].write_bytes(b"garbage")
    with pytest.raises(ValueError, match="no valid checkpoint .*checksum"):
        SynchronizerState.load(tmp_path)


def test_a_save_killed_while_pruning_leaves_a_directory_that_loads(tmp_path, monkeypatch):
    """A kill between the two unlinks of a pruned checkpoint (SIGKILL under load, test_crash.py)."""
    state, paths = _saved(tmp_path, rounds=KEEP)
    real_unlink, calls = type(paths[0]).unlink, []

    def unlink_then_die(self, missing_ok=False):
        calls.append(self.name)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the two unlinks")
        return real_unlink(self, missing_ok=missing_ok)

    _advance(state, 1)
    monkeypatch.setattr(type(paths[0]), "unlink", unlink_then_die)
    with pytest.raises(KeyboardInterrupt):
        state.save(tmp_path)
    monkeypatch.undo()
    assert SynchronizerState.load(tmp_path) is not None  # the newest, whatever of the oldest is left


def test_a_summary_whose_checkpoint_was_deleted_is_an_error(tmp_path):
    _, paths = _saved(tmp_path, rounds=1)
    paths[0].unlink()
    with pytest.raises(ValueError, match="lost their .pt files"):
        SynchronizerState.load(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere; the service test uses a file in the way")
def test_an_unwritable_directory_is_refused_at_once(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable"):
            check_writable(tmp_path / "ckpt")
    finally:
        tmp_path.chmod(0o700)


def test_a_path_that_is_a_file_is_refused_at_once(tmp_path):
    (tmp_path / "ckpt").write_text("not a folder")
    with pytest.raises(ValueError, match="not writable"):
        check_writable(tmp_path / "ckpt")
