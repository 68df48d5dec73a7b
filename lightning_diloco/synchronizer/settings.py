"""How one synchronizer runs, beside the run's settings (``RunConfig``, the same for every island
and shard): :class:`SynchronizerSettings`, built by the command line (main.py, whose flag of the
same name explains each field), an island's embedded synchronizer (the defaults) and the
simulator (its virtual clock)."""

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
    checkpoint_dir: str | Path | None = None  # None: no checkpoints
    checkpoint_every: int = 0  # outer steps between checkpoints (0: only on close)
    recovery_wait: float = RECOVERY_WAIT
    run_id: str | None = None  # None: the checkpoint's (or, starting afresh, a new one)
    layout_hash: str | None = None  # None: the first joiner's layout is adopted
    num_islands: int | None = None  # None: the count a quorum of the islands says (admission.py), never one island's
    liveness_timeout: float = LIVENESS_TIMEOUT
    clock: Callable[[], float] = time.monotonic
