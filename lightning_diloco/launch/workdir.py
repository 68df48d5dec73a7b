"""A run's folder: a new run never continues an earlier one by accident.

A folder that holds an earlier run (the synchronizer's checkpoint, progress files, island
checkpoints) would make a new run resume it: islands start at the old run's step, step-triggered
faults fire at once on the old progress files, and the figures mix both runs. So a new run moves
the earlier one aside to a sibling ``FOLDER.prev-<timestamp>`` and says so in one line;
continuing is explicit (``--resume``). A folder that holds anything else besides run files is
never moved: the run is refused, naming the fix.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Sequence
from pathlib import Path

# What `lightning-diloco run` writes into its --workdir (the logs: with --progress-every).
RUN_FILES = ("synchronizer", "progress-*", "checkpoints-*", "run-config.json", "island-*.log", "synchronizer.log",
             "ddp-job.log")


def progress_file(workdir: Path, unit: int) -> Path:
    """Where island ``unit`` (with ``--baseline ddp``: the DDP job, 0) writes its progress (``DILOCO_PROGRESS_FILE``)."""
    return workdir / f"progress-{unit}.txt"


def checkpoint_folder(workdir: Path, unit: int) -> Path:
    """Where island ``unit`` saves its own checkpoints to resume from (``DILOCO_CHECKPOINT_DIR``)."""
    return workdir / f"checkpoints-{unit}"


class FolderInUse(ValueError):
    """The folder holds an earlier run and other files: it cannot be moved aside safely."""


def earlier_run(folder: Path, run_files: Sequence[str] = RUN_FILES) -> list[str]:
    """The names in ``folder`` that an earlier run left there (empty: nothing to continue)."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if any(fnmatch.fnmatch(p.name, pattern) for pattern in run_files))


def set_aside(folder: str | Path, *, resume: bool, run_files: Sequence[str] = RUN_FILES, flag: str = "--workdir") -> str | None:
    """Prepare ``folder`` for a new run, or for continuing the one in it (``resume``).

    Returns the line to tell the user (None when there is nothing to say). An earlier run is
    moved to ``FOLDER.prev-<timestamp>``; a folder that also holds other files raises
    :class:`FolderInUse`, as does one that is the current directory or holds it.
    """
    folder = Path(folder)
    found = earlier_run(folder, run_files)
    if resume:
        if found:
            return f"[launcher] continuing the run in {folder} (--resume)\n"
        return f"[launcher] --resume: {folder} holds no earlier run; starting a new one\n"
    if not found:
        return None
    others = sorted(p.name for p in folder.iterdir() if p.name not in found)
    here = Path.cwd().resolve()
    if others or folder.resolve() in (here, *here.parents):
        listed = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "") if others else "the current directory"
        raise FolderInUse(
            f"{folder} holds an earlier run ({', '.join(found[:5])}) beside {listed}; pass --resume to continue it, "
            f"or give a new {flag} (or remove the earlier run's files)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder.with_name(f"{folder.name}.prev-{stamp}")
    n = 1
    while target.exists():  # two runs within a second
        target = folder.with_name(f"{folder.name}.prev-{stamp}-{n}")
        n += 1
    folder.rename(target)
    folder.mkdir()
    return f"[launcher] {folder} held an earlier run: moved it to {target} (pass --resume to continue a run instead)\n"
