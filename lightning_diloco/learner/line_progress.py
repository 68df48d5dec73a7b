"""Training progress as lines, for an island whose output is a pipe or a file (under
``lightning-diloco run``, which sets ``$DILOCO_PROGRESS_LINES``): Lightning's bars redraw one line
in place, which a pipe shows as one last frame (Rich) or a line per redraw (tqdm)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from lightning.pytorch.callbacks import ProgressBar

from lightning_diloco.learner.arguments import PROGRESS_LINES_ENV


class LineProgressBar(ProgressBar):
    """Training progress as a line every ``every`` seconds and at each epoch's end: ``Epoch 1/3:
    40/100 batches, step 140, 12.5 it/s, loss 0.123``.

    Lightning's bars (Rich's, tqdm's) redraw one line in place: written to a pipe, as the
    launcher reads an island's output, Rich's shows only its last frame, once training has ended,
    and tqdm's a line per redraw. Each line here stands alone, in a log file or behind the
    launcher's ``[island i]`` prefix."""

    def __init__(self, every: float = 10.0) -> None:
        super().__init__()
        self.every = every
        self._enabled = True
        self._next = 0.0
        self._epoch_start = 0.0  # monotonic time when the epoch began
        self._shown = (-1, 0)  # the epoch and batch count of the latest line

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self._enabled:
            print(*args, **kwargs, flush=True)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._epoch_start = time.monotonic()
        self._next = time.monotonic() + self.every

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + self.every
            self._shown = (trainer.current_epoch, batch_idx + 1)
            self.print(self.line(trainer, pl_module, batch_idx + 1))

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        if self._shown != (trainer.current_epoch, batches):  # not just said by the last batch
            self.print(self.line(trainer, pl_module, batches))

    def line(self, trainer: Any, pl_module: Any, batches: int) -> str:
        total = self.total_train_batches
        epochs = f"/{trainer.max_epochs}" if trainer.max_epochs not in (None, -1) else ""
        parts = [f"Epoch {trainer.current_epoch + 1}{epochs}: {batches}"
                 + (f"/{total}" if total != float("inf") else "") + " batches", f"step {trainer.global_step}"]
        elapsed = time.monotonic() - self._epoch_start
        if elapsed > 0 and batches:
            parts.append(f"{batches / elapsed:.2f} it/s")
        for name, value in self.get_metrics(trainer, pl_module).items():
            if name != "v_num":
                parts.append(f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}")
        return ", ".join(parts)


def use_line_progress(trainer: Any) -> None:
    """Under the launcher (``$DILOCO_PROGRESS_LINES`` set) and writing to a pipe or a file,
    ``trainer``'s Lightning bar (Rich's or tqdm's, as Lightning or the script chose it) is
    replaced by a :class:`LineProgressBar`; a bar of the script's own kind (a subclass) is kept."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    every = os.environ.get(PROGRESS_LINES_ENV)
    bar = trainer.progress_bar_callback
    if not every or type(bar) not in (RichProgressBar, TQDMProgressBar) or sys.stdout.isatty():
        return
    lines = LineProgressBar(float(every))
    lines.setup(trainer, trainer.lightning_module, "fit")  # the hooks that set the bar up have run
    trainer.callbacks[trainer.callbacks.index(bar)] = lines
