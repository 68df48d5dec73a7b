"""DiLoCoMonitor: the island's sync state in the progress bar, and the global model's quality."""

from __future__ import annotations

from contextlib import ExitStack

from lightning.pytorch.callbacks import Callback


class DiLoCoMonitor(Callback):
    """Shows version, syncs applied and synchronizer reachability in the progress bar.

    With ``evaluate_global=True`` validation runs on the current global model (the island's
    last received global fragments) instead of its local weights, which is the model the run
    actually produces; the local weights are put back afterwards.
    """

    def __init__(self, evaluate_global: bool = False) -> None:
        self.evaluate_global = evaluate_global
        self._swap: ExitStack | None = None

    @staticmethod
    def _learner(trainer):
        return getattr(trainer.strategy, "learner", None)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        learner = self._learner(trainer)
        if learner is None:
            return
        m = learner.metrics()
        # the strategy logs these to the loggers under the same names: the bar only shows them
        for name in ("diloco/min_version", "diloco/syncs_applied", "diloco/synchronizer_reachable"):
            pl_module.log(name, m[name], prog_bar=True, logger=False, on_step=True, on_epoch=False)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._restore()  # a second validation in a row: from the local weights again
        learner = self._learner(trainer)
        if not (self.evaluate_global and learner is not None):
            return
        self._swap = ExitStack()
        self._swap.enter_context(learner.global_weights())

    def _restore(self) -> None:
        if self._swap is not None:
            self._swap.close()  # the local weights are back
            self._swap = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._restore()

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore()

    def teardown(self, trainer, pl_module, stage) -> None:
        self._restore()
