"""The synchronizer's checkpoint files: checksummed, the last few kept, the newest valid one loaded.

In a checkpoint directory each checkpoint is a pair written atomically (temporary file, fsync,
rename): ``synchronizer-<outer steps>.pt`` (one ``torch.save`` of plain tensors, numbers and
strings, loadable with ``weights_only=True``) and ``synchronizer-<outer steps>.json`` (a readable
summary carrying the SHA-256 of the ``.pt``). ``synchronizer.json`` repeats the newest summary.

Loading tries the checkpoints newest first. One that fails its checksum, does not load, or holds
a non-finite value is reported by path and skipped; if every one fails, or a summary has lost its
``.pt`` (``synchronizer.json`` included), loading raises instead of starting afresh: a run's
progress is never silently dropped. Summaries name whose state they hold (run id, shard and
shard count, layout hash): checkpoints of two runs or two shards in one directory are refused,
naming both, rather than one resumed with the other's values. Temporary files a killed write
left behind are removed at load.

A directory has one owner at a time: a synchronizer holds an OS lock (``flock``) on
``synchronizer.lock`` in it while it runs (:class:`DirectoryLock`), and a second one started on
the same directory is refused at start, naming the holder written into that file. (Two shards
once shared a directory unnoticed, each overwriting the other's checkpoints, until a restart
refused both.) The kernel drops the lock when its process ends, however it ends, so a SIGKILLed
synchronizer leaves no stale lock behind, only the file naming its last holder.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
import os
import re
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

if sys.platform != "win32":  # Windows has no fcntl: there a directory's second owner is not detected
    import fcntl

log = logging.getLogger(__name__)
R = TypeVar("R")

KEEP = 3
LATEST = "synchronizer.json"
LOCK = "synchronizer.lock"
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


class DirectoryLock:
    """The hold of one synchronizer on its checkpoint directory, until :meth:`release` (or the
    process's end). The lock is on an open file description, so a second synchronizer in the
    same process is refused as well as one in another process."""

    def __init__(self, directory: Path, fd: int | None) -> None:
        self.directory, self._fd = directory, fd
        self.since = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    def record(self, holder: dict) -> None:
        """Write who holds the lock (``holder``, e.g. its shard and run, with this process's id
        and host and the time it took the lock) into the file, for whoever is refused next."""
        if self._fd is None:
            return
        data = json.dumps({**holder, "pid": os.getpid(), "host": socket.gethostname(), "since": self.since}).encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
        except OSError as err:  # only the message of a later refusal loses by it
            log.warning("could not write this synchronizer's name into %s: %s", self.directory / LOCK, err)

    def release(self) -> None:
        """Let another synchronizer have the directory (idempotent). The file stays: deleting it
        would let a process that opened it before the deletion lock a file no one else sees."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor drops the flock


def lock_directory(directory: str | os.PathLike, holder: dict) -> DirectoryLock:
    """Take ``directory``'s lock (the directory must exist) for ``holder`` (:meth:`DirectoryLock.record`);
    ValueError naming the current holder when another synchronizer has it."""
    directory = Path(directory)
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    if sys.platform == "win32":
        return DirectoryLock(directory, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        theirs = _read_holder(fd)
        os.close(fd)
        raise ValueError(f"checkpoint directory {directory} is in use by another synchronizer ({describe_holder(theirs)}): "
                         "two synchronizers writing one directory overwrite each other's checkpoints. Give each shard "
                         "its own --checkpoint-dir, or stop that synchronizer first") from None
    except OSError as err:  # a file system without locks (some network ones): run, but say what is not checked
        log.warning("cannot lock %s (%s): a second synchronizer started on this directory will not be refused; give "
                    "each shard its own --checkpoint-dir", directory / LOCK, err.strerror or err)
    lock = DirectoryLock(directory, fd)
    lock.record(holder)
    return lock


def _read_holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):  # being written at this moment, or damaged
        return {}
    return holder if isinstance(holder, dict) else {}


def describe_holder(holder: dict) -> str:
    if not holder.get("pid"):
        return "which has not written its name into the lock file yet"
    text = f"pid {holder['pid']} on host {holder.get('host')!r}, shard {holder.get('shard')} of {holder.get('num_shards')}"
    if holder.get("run_id"):
        text += f", run {holder['run_id']!r}"
    return text + (f", since {holder['since']}" if holder.get("since") else "")


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
        # the summary first: a kill between the two leaves an old .pt without one, which loading
        # skips; the other order left a summary without its .pt, which loading refuses (as a
        # deleted checkpoint), and a synchronizer SIGKILLed while pruning could not restart
        old.with_suffix(".json").unlink(missing_ok=True)
        old.unlink(missing_ok=True)
    return path


def load(directory: str | os.PathLike, restore: Callable[[dict], R], *, tidy: bool = True) -> R | None:
    """``restore(state_dict)`` of the newest valid checkpoint in ``directory``; None when there is none.

    ``restore`` raises ValueError for a state it cannot use; such a checkpoint is skipped too.
    ``tidy``: remove the temporary files of writes cut short (the synchronizer's own start).
    False: only read, as an export does: a running synchronizer's write in progress is such a file.
    """
    directory = Path(directory)
    if not directory.exists():
        return None
    for leftover in directory.glob(".synchronizer*.tmp") if tidy else ():  # a write killed before its rename
        log.warning("removing %s, left by a checkpoint write that did not finish", leftover)
        leftover.unlink(missing_ok=True)
    orphans = [p.name for p in directory.glob("synchronizer-*.json") if _NAME.match(p.name) and not p.with_suffix(".pt").exists()]
    if (directory / LATEST).exists() and not _checkpoints(directory):
        orphans.append(LATEST)
    if orphans:
        raise ValueError(f"checkpoint summaries {sorted(orphans)} in {directory} have lost their .pt files; restore them, "
                         "or move the folder away to start the run afresh")
    _check_one_owner(directory)
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


def _owner(summary: dict) -> tuple:
    identity = summary.get("identity") or {}
    return identity.get("run_id"), identity.get("shard"), identity.get("num_shards"), summary.get("layout_hash")


def describe_owner(identity: dict, layout_hash: str | None = None) -> str:
    text = f"run {identity.get('run_id')!r}, shard {identity.get('shard')} of {identity.get('num_shards')}"
    return text + (f", layout {layout_hash}" if layout_hash else "")


def _check_one_owner(directory: Path) -> None:
    """Every checkpoint in ``directory`` belongs to one run, shard and layout (older ones, which
    name no owner, excepted)."""
    owners: dict[tuple, str] = {}
    for path in sorted(directory.glob("synchronizer-*.json")):
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a damaged summary: its checkpoint is skipped by path when loaded
        if (summary.get("identity") or {}).get("run_id") is not None:
            owners.setdefault(_owner(summary), path.name)
    if len(owners) > 1:
        (a, first), (b, second) = list(owners.items())[:2]
        raise ValueError(f"{directory} holds checkpoints of two owners: {first} is "
                         f"{describe_owner(dict(zip(('run_id', 'shard', 'num_shards'), a)), a[3])} and {second} is "
                         f"{describe_owner(dict(zip(('run_id', 'shard', 'num_shards'), b)), b[3])}; give each run and "
                         "shard its own --checkpoint-dir and move the stray files away")


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
