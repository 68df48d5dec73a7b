"""Progress under the launcher: files that tell it how far a job got (any strategy). The islands'
progress bars as lines are the learner's (learner/line_progress.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from lightning_diloco.launch.supervisor import Progress

ENV = "DILOCO_PROGRESS_FILE"
LOSS_EVERY_S = 1.0  # reading the loss waits for the device: once a second, not every step


class ProgressFile(Callback):
    """Writes the trainer's global step, its max_steps and the latest training loss to
    ``$DILOCO_PROGRESS_FILE`` after each batch (rank 0), in the form
    :func:`~lightning_diloco.launch.supervisor.read_progress_line` reads.

    A no-op when the variable is unset, so scripts can always add it.
    """

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path else (Path(os.environ[ENV]) if os.environ.get(ENV) else None)
        self._loss: float | None = None
        self._loss_at = float("-inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.path is None or not trainer.is_global_zero:
            return
        now = time.monotonic()
        if now - self._loss_at >= LOSS_EVERY_S:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is not None and hasattr(loss, "item"):
                self._loss, self._loss_at = float(loss.detach().float().item()), now
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(Progress(trainer.global_step, trainer.max_steps, self._loss).line())
        os.replace(tmp, self.path)  # readers never see a half-written line

