"""The synchronizer's checkpoints, written on a thread of their own so rounds never wait for a disk.

A closer that finished a round only signals that a checkpoint may be due; this thread writes one
at a time, folding the signals that arrive meanwhile into the next write (which saves the state
as it is by then). A failed write is logged, counted in Status and retried with backoff: it never
turns a merge into an error. Files and their checks: core/checkpoints.py.

A synchronizer holds its directory from start to stop (:class:`CheckpointDirectory`): a second one on the same
directory, another shard started with the same --checkpoint-dir most likely, is refused at start
instead of overwriting the first one's checkpoints.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from lightning_diloco.core import checkpoints
from lightning_diloco.core.checkpoints import DirectoryLock, describe_owner
from lightning_diloco.core.state import SynchronizerState
from lightning_diloco.core.threads import single_threaded_torch
from lightning_diloco.synchronizer import version_log
from lightning_diloco.synchronizer.admission import layout_pin_problem, pinned_num_islands
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.synchronizer.version_log import VersionLog

log = logging.getLogger(__name__)


def resume(directory: Path | None, identity: dict, layout_hash: str | None) -> SynchronizerState | None:
    """The newest valid checkpoint in ``directory`` (None: none, or no directory), after checking
    the directory is writable and the checkpoint is this synchronizer's: its shard and shard count,
    its run (``identity['run_id']``; None: any, then set to the checkpoint's) and its layout
    (``layout_hash``; None: any). Anything else is refused naming both."""
    if directory is None:
        return None
    checkpoints.check_writable(directory)
    loaded = SynchronizerState.load(directory)
    if loaded is None:
        return None
    theirs = loaded.identity
    if theirs:  # checkpoints of older versions name no owner
        ours = {**identity, "run_id": identity["run_id"] or theirs.get("run_id")}
        if any(theirs.get(k) != v for k, v in ours.items()):
            raise ValueError(f"the checkpoint in {directory} is {describe_owner(theirs)}, but this synchronizer is "
                             f"{describe_owner(ours)}; give each run and shard its own --checkpoint-dir (or pass the "
                             "checkpoint's --run-id)")
        identity["run_id"] = ours["run_id"]
    problem = layout_pin_problem(layout_hash, loaded.layout.hash)
    if problem:
        raise ValueError(f"the checkpoint in {directory}: {problem}")
    # a user who reruns a command with the same --checkpoint-dir continues the earlier run: say so
    log.info("resumed run %s from %s after %d outer steps (versions %s); a new run needs a new --checkpoint-dir",
             identity["run_id"] or "(unnamed)", directory, loaded.outer_steps, loaded.versions())
    return loaded


class CheckpointDirectory:
    """What a synchronizer starts from in ``settings.checkpoint_dir`` (``path``; None: it keeps no
    checkpoints), held until :meth:`release`: the checkpoint there (``loaded``; None: none), the
    run's island count (the operator's, the checkpoint's or ``given``'s, the state it was given;
    0: not yet, admission.py), the version log and its digests, and the run and shard its
    checkpoints are stamped with (``identity``). A refused start leaves the directory to the next try."""

    def __init__(self, settings: SynchronizerSettings, given: SynchronizerState | None) -> None:
        self.path = Path(settings.checkpoint_dir) if settings.checkpoint_dir else None
        self.identity = {"run_id": settings.run_id, "shard": settings.shard, "num_shards": settings.num_shards}
        self.lock: DirectoryLock | None = None
        if self.path is not None:  # taken before the checkpoint is read: the holder may be writing one
            checkpoints.check_writable(self.path)
            self.lock = checkpoints.lock_directory(self.path, self.identity)  # a second holder is refused, named
        try:
            self.loaded = resume(self.path, self.identity, settings.layout_hash)  # refused at start, not after the first merges
            restored = self.loaded if self.loaded is not None else given
            checkpointed = restored.num_islands if restored is not None else 0
            self.num_islands = pinned_num_islands(settings.num_islands, checkpointed, self.path)
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise
        # every published version's digest, logged before it is seen: what a restart gets back
        self.logged = version_log.read(self.path)
        self.versions = VersionLog(self.path) if self.path is not None else None
        self.identity["run_id"] = self.identity["run_id"] or uuid.uuid4().hex[:16]
        if self.lock is not None:  # now with the run's id, for the message of a second one
            self.lock.record(self.identity)

    def release(self) -> None:
        """Let another synchronizer (this one restarted in-process, say) take the directory.
        Idempotent; the process's end releases it too, however it ends."""
        if self.lock is not None:
            if self.versions is not None:
                self.versions.close()
            self.lock.release()


class Checkpointer:
    def __init__(self, directory: Path | None, every: int, *, snapshot: Callable[[], SynchronizerState | None],
                 outer_steps: Callable[[], int], closing: threading.Event, due: threading.Event,
                 versions: VersionLog | None = None) -> None:
        """``every``: outer steps between checkpoints (0: only when asked); ``snapshot()``: a
        consistent copy of the state to save (None before the first join); ``outer_steps()``:
        the live state's count, to tell when one is due; ``due``: set after each close, when one
        may be due; ``versions``: the version log, compacted after each checkpoint."""
        self.directory, self.every, self.versions = directory, every, versions
        self.snapshot, self.outer_steps, self.closing, self.due = snapshot, outer_steps, closing, due
        self.lock = threading.Lock()
        self.last_steps = outer_steps()
        self.failures, self.last_error = 0, ""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and self.directory is not None and self.every > 0:
            self._thread = threading.Thread(target=self._loop, name="diloco-checkpointer", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Call once ``closing`` is set."""
        self.due.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def write_if_due(self) -> None:
        if self.directory is not None and self.every > 0 and self.outer_steps() - self.last_steps >= self.every:
            self.write()

    def write(self) -> Path | None:
        """Write a checkpoint now (no-op without a directory or a state)."""
        if self.directory is None:
            return None
        with self.lock:
            snapshot = self.snapshot()
            if snapshot is None:
                return None
            path = snapshot.save(self.directory)
            self.last_steps = snapshot.outer_steps
            if self.versions is not None:
                self.versions.compact(snapshot.versions())
        log.debug("checkpoint at %d outer steps: %s", snapshot.outer_steps, path)
        return path

    def _loop(self) -> None:
        single_threaded_torch()
        closing = self.closing
        while not closing.is_set():
            self.due.wait()
            self.due.clear()
            if closing.is_set():
                return
            try:
                self.write_if_due()
            except Exception as err:  # noqa: BLE001 - a full or broken disk must not stop the rounds
                self.failures += 1
                self.last_error = f"{type(err).__name__}: {err}"[:300]
                backoff = min(30.0, 2.0 ** self.failures)
                log.error("checkpoint into %s failed (%s); rounds go on, retrying in %.0f s", self.directory, err, backoff)
                closing.wait(backoff)
                self.due.set()
