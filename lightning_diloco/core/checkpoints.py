"""The synchronizer's checkpoint files: checksummed, the last few kept, the newest valid one loaded.

In a checkpoint directory each checkpoint is a pair written atomically (temporary file, fsync,
rename): ``synchronizer-<outer steps>.pt`` (one ``torch.save`` of plain tensors, numbers and
strings, loadable with ``weights_only=True``) and ``synchronizer-<outer steps>.json`` (a readable
summary carrying the SHA-256 of the ``.pt``). ``synchronizer.json`` repeats the newest summary.

Loading tries the checkpoints newest first. One that fails its checksum, does not load, or holds
a non-finite value is reported by path and skipped; if every one fails, or a summary has lost its
``.pt``, loading raises instead of starting afresh: a run's progress is never silently dropped.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KEEP = 3
LATEST = "synchronizer.json"
_NAME = re.compile(r"^synchronizer-(\d+)\.(pt|json)$")


def check_writable(directory: str | os.PathLike) -> Path:
    """Create ``directory`` if needed and prove a file can be written there; ValueError if not."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"checkpoint directory {directory} is not writable ({err.strerror or err}); "
                         "give --checkpoint-dir a folder this process can write") from None
    return directory


def save(state_dict: dict, summary: dict, directory: str | os.PathLike, keep: int = KEEP) -> Path:
    """Write one checkpoint pair, then drop all but the newest ``keep``; returns the ``.pt`` path."""
    directory = Path(directory)
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    data = buffer.getvalue()
    steps = int(summary["outer_steps"])
    path = directory / f"synchronizer-{steps:012d}.pt"
    summary = {**summary, "checkpoint": path.name, "sha256": hashlib.sha256(data).hexdigest()}
    text = json.dumps(summary, indent=2).encode()
    _atomic_write(path, data)
    _atomic_write(path.with_suffix(".json"), text)
    _atomic_write(directory / LATEST, text)
    for old in _checkpoints(directory)[keep:]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
    return path


def load(directory: str | os.PathLike, restore: Callable[[dict], object]) -> object | None:
    """``restore(state_dict)`` of the newest valid checkpoint in ``directory``; None when there is none.

    ``restore`` raises ValueError for a state it cannot use; such a checkpoint is skipped too.
    """
    directory = Path(directory)
    if not directory.exists():
        return None
    orphans = [p.name for p in directory.glob("synchronizer-*.json") if _NAME.match(p.name) and not p.with_suffix(".pt").exists()]
    if orphans:
        raise ValueError(f"checkpoint summaries {sorted(orphans)} in {directory} have lost their .pt files; restore them, "
                         "or move the folder away to start the run afresh")
    skipped = []
    for path in _checkpoints(directory):
        try:
            return restore(_verified(path))
        except (ValueError, OSError, RuntimeError, KeyError, TypeError, EOFError) as err:
            why = f"{path}: {str(err)[:300]}"
            log.error("skipping checkpoint %s", why)
            skipped.append(why)
    if skipped:
        raise ValueError(f"no valid checkpoint in {directory}: " + "; ".join(skipped)
                         + ". Move the folder away to start the run afresh.")
    return None


def _verified(path: Path) -> dict:
    summary_path = path.with_suffix(".json")
    if not summary_path.exists():
        raise ValueError("its summary (with the checksum) is missing")
    summary = json.loads(summary_path.read_text())
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != summary.get("sha256"):
        raise ValueError(f"its checksum does not match its summary's (a corrupt or truncated file of {len(data)} bytes)")
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    for name, tensor in _tensors(state):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name} holds non-finite values")
    return state


def _tensors(obj, name: str = "state"):
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{name}[{k!r}]")


def _checkpoints(directory: Path) -> list[Path]:
    """The ``.pt`` files, newest (most outer steps) first."""
    found = [(int(m[1]), p) for p in directory.glob("synchronizer-*.pt") if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
