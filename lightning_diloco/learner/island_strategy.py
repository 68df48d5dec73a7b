"""What makes a Lightning Trainer's strategy a learner island, whatever its inner parallelism.

:class:`IslandStrategy` is mixed in before a Lightning strategy (``class S(IslandStrategy,
DDPStrategy)``): the inner strategy runs the island's ranks as it always does (DDP, FSDP2, ...),
and around it the mixin joins the run when training starts, counts tokens, hands control to
:class:`~lightning_diloco.learner.island.IslandLearner` after every inner optimizer step, logs
its metrics, saves its outer state in checkpoints and tears it down. Hooks only; Lightning's loops
are never copied. The island itself (run settings, joining, outer state, metrics, the end) is
:class:`~lightning_diloco.learner.island_membership.IslandMembership`, shared with Fabric's
strategies (:mod:`~lightning_diloco.learner.fabric_island`). The island sees the model's
parameters whole or sharded (DTensors: FSDP2, tensor parallelism, HSDP):
:mod:`~lightning_diloco.learner.shards` moves fragments between the two, so adding an inner
parallelism is a new inner strategy, not a new island.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_diloco.core.config import RunConfig
from lightning_diloco.learner.data import rank_of, split_for, unsplit_iterables, unsplit_warning
from lightning_diloco.learner.island_membership import CHECKPOINT_KEY, IslandMembership

if TYPE_CHECKING:  # mixed in before a Lightning strategy: the type checker sees what it is mixed into
    from lightning.pytorch.strategies import ParallelStrategy as _MixedInto
else:
    _MixedInto = object


class IslandStrategy(IslandMembership, _MixedInto):
    """A Lightning Trainer strategy's island hooks; the island is :class:`IslandMembership`'s,
    the other half a Lightning strategy."""

    # ---- data: island i of M trains on shard i of M (learner/data.py) -------------------------

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # where Lightning lets a strategy change each loader, after its sampler is injected: an
        # iterable dataset got none, and a Hugging Face one is split here for the same data rank
        return super().process_dataloader(split_for(dataloader, rank_of(self.distributed_sampler_kwargs)))

    def _warn_of_unsplit_data(self, trainer) -> None:
        """Said when training starts: an iterable dataset no one split trains every island on the
        same samples, and nothing else would show it."""
        from lightning.pytorch.utilities import rank_zero_warn
        from lightning_utilities.core.apply_func import apply_to_collection

        part = rank_of(self.distributed_sampler_kwargs)
        if part.world_size == 1 or self.data_split_by_script:
            return
        loaders: list[object] = []
        apply_to_collection(trainer.train_dataloader, (DataLoader, IterableDataset), loaders.append)
        names = unsplit_iterables(loaders)
        if names:
            rank_zero_warn(unsplit_warning(names, self.island, self.num_islands, part))

    # ---- joining: after the inner strategy's setup and any checkpoint restore ------------------

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        self._join_after_setup(trainer)

    def _join_after_setup(self, trainer) -> None:
        # a strategy that restores its checkpoint after setup (ModelParallelStrategy) would then
        # overwrite the global weights the join writes: it joins when training starts instead
        from lightning.pytorch.trainer.states import TrainerFn  # not at import: see _registration.py

        if trainer.state.fn == TrainerFn.FITTING and not self.restore_checkpoint_after_setup:
            self._join()

    @override
    def on_train_start(self) -> None:
        if self.learner is None:
            self._join()
        self._warn_of_unsplit_data(self.lightning_module.trainer)
        self._stop_waiting_on_sigterm()
        super().on_train_start()

    def _stop_waiting_on_sigterm(self) -> None:
        """Installed when fit starts, after Lightning installed its SIGTERM handler (which only asks
        the loop to stop once the current batch ends): the island's waits for rounds end first
        (:mod:`~lightning_diloco.learner.sigterm`). Teardown puts Lightning's back."""
        self._sigterm.install(self._stop_waits)

    def _island_module(self):
        return self.lightning_module

    def _joined(self, config: RunConfig) -> None:
        for logger in self.lightning_module.trainer.loggers:  # the run's settings beside the module's hyperparameters
            logger.log_hyperparams(self.hyperparameters(config))
        # the learner's step, restored from a checkpoint: the trainer's global_step is restored after setup
        self._info(self._start_line(config, self.learner.step))

    # ---- the inner loop ------------------------------------------------------------------------

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        batch = args[0] if args else kwargs.get("batch")
        self._tokens += self.count_tokens(batch)
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        # one inner step per step of the first optimizer (GAN-style modules have several)
        if self.learner is not None and self.optimizers and optimizer is _unwrap(self.optimizers[0]):
            self.learner.after_step(self._tokens)
            self._tokens = 0.0
            self._log_metrics()
        return output

    def _log_metrics(self) -> None:
        # Through the module's own logging, on the steps the trainer writes its logs: the island's
        # metrics land in the module's rows (a logger call of our own made a second row per step)
        trainer = self.lightning_module.trainer
        module = self.lightning_module
        if trainer.loggers and module._current_fx_name is not None and trainer._logger_connector.should_update_logs:
            module.log_dict(self.learner.metrics(), on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_train_end(self) -> None:
        if self.learner is not None and self.end_with_global_model:
            self.learner.finish()
        super().on_train_end()

    # ---- checkpoints -----------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self.learner is not None:
            checkpoint[CHECKPOINT_KEY] = self._outer_state(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume = checkpoint.get(CHECKPOINT_KEY)
        return checkpoint

    @override
    def teardown(self) -> None:
        self._sigterm.restore()
        self._leave_run()
        super().teardown()


def _unwrap(optimizer):
    return getattr(optimizer, "_optimizer", optimizer)
