"""The island a Lightning Trainer's strategy holds: :class:`TrainerIsland`, the Trainer's hooks.

A Trainer strategy (DDP: :mod:`~lightning_diloco.learner.strategy`; FSDP2:
:mod:`~lightning_diloco.learner.fsdp_strategy`) runs the island's ranks as its Lightning base
always does, and forwards its hooks here: the island joins the run when training starts, counts
tokens, hands control to :class:`~lightning_diloco.learner.island.IslandLearner` after every
inner optimizer step, logs its metrics, saves its outer state in checkpoints and leaves the run
at teardown. Hooks only; Lightning's loops are never copied.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightning_diloco.learner.data import rank_of
from lightning_diloco.learner.island_membership import CHECKPOINT_KEY, IslandMembership


class TrainerIsland(IslandMembership):
    """An island as a Lightning Trainer's strategy drives it (``host``: that strategy)."""

    def after_setup(self, trainer: Any) -> None:
        # a strategy that restores its checkpoint after setup (ModelParallelStrategy) would then
        # overwrite the global weights the join writes: it joins when training starts instead
        from lightning.pytorch.trainer.states import TrainerFn

        from lightning_diloco.learner.line_progress import use_line_progress

        use_line_progress(trainer)  # under the launcher: its output is a pipe
        if trainer.state.fn == TrainerFn.FITTING and not self.host.restore_checkpoint_after_setup:
            self._join_trainer()

    def on_train_start(self) -> None:
        if self.learner is None:
            self._join_trainer()
        self._warn_of_unsplit_data(self.host.lightning_module.trainer)
        # after Lightning installed its SIGTERM handler (which only asks the loop to stop once the
        # current batch ends): the island's waits for rounds end first (learner/sigterm.py)
        self.sigterm.install(self.stop_waits)

    def _join_trainer(self) -> None:
        module = self.host.lightning_module
        self.join(module, loggers=module.trainer.loggers)

    def _warn_of_unsplit_data(self, trainer: Any) -> None:
        from lightning_utilities.core.apply_func import apply_to_collection

        loaders: list[object] = []
        apply_to_collection(trainer.train_dataloader, (DataLoader, IterableDataset), loaders.append)
        self.warn_of_unsplit_data(loaders, rank_of(self.host.distributed_sampler_kwargs))

    def after_optimizer_step(self, optimizer: Any) -> None:
        # one inner step per step of the first optimizer (GAN-style modules have several)
        optimizers = self.host.optimizers
        if self.learner is not None and optimizers and optimizer is getattr(optimizers[0], "_optimizer", optimizers[0]):
            self.after_step()
            # through the module's own logging, on the steps the trainer writes its logs: the
            # island's metrics land in the module's rows (a logger call of our own made a second row)
            module = self.host.lightning_module
            trainer = module.trainer
            if trainer.loggers and module._current_fx_name is not None and trainer._logger_connector.should_update_logs:
                module.log_dict(self.learner.metrics(), on_step=True, on_epoch=False, batch_size=1)

    def save(self, checkpoint: dict[str, Any], learner_state: dict | None = None) -> None:
        if self.learner is not None:
            checkpoint[CHECKPOINT_KEY] = self.outer_state(learner_state)

    def load(self, checkpoint: dict[str, Any]) -> None:
        self.resume = checkpoint.get(CHECKPOINT_KEY)


def fabric_repr(strategy: Any, fabric_class: str, note: str = "") -> str:
    """A Trainer island strategy, and the Fabric one to give Fabric instead (the token left out: a
    secret). Fabric calls a Trainer strategy "an invalid strategy name" and shows its repr: it has
    no hook to say more."""
    s = strategy.diloco.settings
    given = {"synchronizer": s.synchronizer, **s.explicit}
    if s.num_islands > 1:
        given.update(island=s.island, num_islands=s.num_islands)
    arguments = ", ".join(f"{k}={v!r}" for k, v in given.items() if v is not None)
    return (f"{type(strategy).__name__}({arguments}), a Lightning Trainer strategy; Fabric takes "
            f"lightning_diloco.{fabric_class}({arguments}) with the same arguments, or "
            f"Fabric(strategy=\"{strategy.strategy_name}\") for the defaults and the DILOCO_* environment" + note)
