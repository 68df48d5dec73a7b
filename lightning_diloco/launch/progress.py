"""Progress files: how a launched job tells the launcher how far it got (any strategy)."""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.callbacks import Callback

ENV = "DILOCO_PROGRESS_FILE"


class ProgressFile(Callback):
    """Writes the trainer's global step to ``$DILOCO_PROGRESS_FILE`` after each batch (rank 0).

    A no-op when the variable is unset, so scripts can always add it.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path else (Path(os.environ[ENV]) if os.environ.get(ENV) else None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.path is None or not trainer.is_global_zero:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(str(trainer.global_step))
        os.replace(tmp, self.path)  # readers never see a half-written number
