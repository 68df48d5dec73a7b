"""How one synchronizer runs, beside the run's settings (``RunConfig``, the same for every island
and shard): :class:`SynchronizerSettings`, built by the command line (main.py), an island's
embedded synchronizer (the defaults) and the simulator (its virtual clock)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lightning_diloco.synchronizer.membership import LIVENESS_TIMEOUT
from lightning_diloco.synchronizer.version_log import RECOVERY_WAIT


@dataclass(frozen=True)
class SynchronizerSettings:
    shard: int = 0
    num_shards: int = 1
    checkpoint_dir: str | Path | None = None
    checkpoint_every: int = 0
    """Outer steps between checkpoints (0: only on close)."""
    recovery_wait: float = RECOVERY_WAIT
    """Seconds after start that a fragment whose logged version is newer than its checkpoint's
    waits for an island to give that version back (version_log.py) before the checkpoint's version
    is served instead."""
    run_id: str | None = None
    """The run's name in its checkpoints: a checkpoint of another run, or of another shard, is
    refused naming both. None: the checkpoint's (or, starting afresh, a new one)."""
    layout_hash: str | None = None
    """The run's layout, pinned: a first joiner (or a checkpoint) with another is refused instead
    of adopted. None: the first joiner's is adopted."""
    num_islands: int | None = None
    """The run's island count, pinned the same way. None: the count a quorum of the islands says
    (admission.py's ``count_agreed``), never one island's."""
    liveness_timeout: float = LIVENESS_TIMEOUT
    """Seconds without a heartbeat (or any request) after which an island is no longer waited for."""
    clock: Callable[[], float] = time.monotonic
