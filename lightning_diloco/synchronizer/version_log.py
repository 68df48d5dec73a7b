"""The synchronizer's version log: every published version's digest, on disk before anyone sees it.

Checkpoints are written every ``--checkpoint-every`` outer steps, on their own thread; a version
published since the last one used to die with a SIGKILLed synchronizer although islands held it
(5 of 8 kills lost versions islands had pulled, 29 in all: benchmarks/RESULTS.md, 2026-11-28).
Saving the model at every outer step would cost a whole model's write per step; this log costs a
line: ``{"fragment": p, "version": v, "sha256": ...}``, the SHA-256 of the version's value *as the
islands hold it* (the published value, core/downlink.py), appended and fsync'd before the version
is visible to any caller (a pull, a subscription event, a push's ack, a heartbeat: core/state.py
``FragmentState.publish_hook`` runs before the version number moves). A seed (version 0) is
logged the same way.

At restart, a fragment whose last logged version is newer than its checkpoint's is *recovering*
(fragment.py): it is served to no one until an island offers that value (a seed whose bytes have
the logged digest), which the synchronizer then takes as the version: a value with another digest,
an island's own or a hostile one, is not taken. An island whose offer was not the last version (a
brand-new one offers its own first weights) has nothing to give back: its pull waits for the
recovery to end (``RECOVERY_PULL_WAIT``) instead of being refused. The log is compacted to its last line per
fragment after each checkpoint, so it holds the fragments' count of lines plus those since.

A line cut short by a kill was never fsync'd, so its version was never seen: reading skips it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FILE = "versions.log"
RECOVERY_SETTLE = 5.0
"""Seconds after a restart that an offer of an older logged version waits for one of the last (an
island that held the last may rejoin a little later than one that held an older one); past them
the newest offered is taken."""
RECOVERY_PULL_WAIT = 10.0
"""Real seconds a pull of a recovering fragment waits for the recovery to end, when its island has
already offered what it holds and that was not the last version (a brand-new island offers its own
first weights): it has nothing to give back, so it waits to be served instead of being refused."""
RECOVERY_WAIT = 300.0
"""Seconds a restarted synchronizer waits for an island to give back a version its log holds and
its checkpoint lacks, before it serves the checkpoint's (and says the versions lost)."""


def value_digest(value: torch.Tensor) -> str:
    """SHA-256 of a fragment's value as fp32 bytes (what a seed carries)."""
    flat = value.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()
    return hashlib.sha256(flat.numpy().data).hexdigest()


def read(directory: Path | None) -> dict[int, list[tuple[int, str]]]:
    """Fragment -> its logged (version, digest)s in ``directory``'s log, ascending, the last one
    the version published last ({} without a log). A line with a version not above the one before
    (the restart took an older one back, or fell back to its checkpoint) starts the list afresh."""
    path = None if directory is None else directory / FILE
    if path is None or not path.exists():
        return {}
    logged: dict[int, list[tuple[int, str]]] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            entry = json.loads(line)
            fragment, version, digest = int(entry["fragment"]), int(entry["version"]), str(entry["sha256"])
        except (ValueError, KeyError, TypeError):  # a line a kill cut short: never fsync'd, so never seen
            log.warning("%s line %d is not a whole entry (a write cut short by a kill): skipped", path, number)
            continue
        versions = logged.setdefault(fragment, [])
        if versions and version <= versions[-1][0]:
            versions.clear()
        versions.append((version, digest))
    return logged


class VersionLog:
    """The log in ``directory``, open for appending (one writer: the directory's lock holder)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / FILE
        self.lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # a kill's torn last line: cut, or the next line would be glued to it
            os.truncate(self.path, data.rfind(b"\n") + 1)
        _fsync_directory(directory)  # the file's own name must survive a crash too

    def record(self, fragment: int, version: int, value: torch.Tensor) -> None:
        """Append ``fragment``'s ``version`` (``value``: as the islands hold it) and fsync; raises
        OSError when the disk refuses, and the caller must not publish the version then."""
        line = json.dumps({"fragment": fragment, "version": version, "sha256": value_digest(value)}) + "\n"
        with self.lock:
            if self._fd < 0:
                raise OSError(f"{self.path} was closed: this synchronizer released its directory, and publishes no more")
            os.write(self._fd, line.encode())
            os.fsync(self._fd)

    def compact(self, checkpointed: dict[int, int]) -> None:
        """Rewrite the log (atomically) with, per fragment, the versions from its checkpointed one
        (``checkpointed``) on, and always its last: after a checkpoint."""
        with self.lock:
            if self._fd < 0:  # closed: the directory is no longer this synchronizer's
                return
            logged = read(self.path.parent)
            tmp = self.path.with_name(f".{FILE}.tmp")
            with open(tmp, "wb") as f:
                for fragment, versions in sorted(logged.items()):
                    kept = [e for e in versions[:-1] if e[0] >= checkpointed.get(fragment, -1)] + versions[-1:]
                    for version, digest in kept:
                        f.write(json.dumps({"fragment": fragment, "version": version, "sha256": digest}).encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            _fsync_directory(self.path.parent)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def close(self) -> None:
        with self.lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
