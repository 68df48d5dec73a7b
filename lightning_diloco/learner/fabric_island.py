"""What makes a Lightning Fabric strategy a learner island, whatever its inner parallelism.

:class:`FabricIsland` is mixed in before a Fabric strategy (DDP:
:mod:`~lightning_diloco.learner.fabric_strategy`; FSDP2:
:mod:`~lightning_diloco.learner.fabric_fsdp_strategy`), as
:class:`~lightning_diloco.learner.island_strategy.IslandStrategy` is before a Trainer's. The
island is :class:`~lightning_diloco.learner.island_membership.IslandMembership`'s; this maps it
onto Fabric's calls, which are the training loop's only hooks:

- ``fabric.setup(model, optimizer)`` (or ``setup_module`` then ``setup_optimizers``) joins the
  run once the module and its (first) optimizer are set up: from then on the module holds the
  global model;
- each step of that optimizer (``optimizer.step()``, which Fabric routes through
  ``optimizer_step``) is an inner step: the island's step boundary runs after it, as after the
  Trainer strategy's optimizer step;
- ``fabric.save(path, state)`` adds the island's outer state to the checkpoint, and
  ``fabric.load(path, state)`` restores it: an island that had already joined joins again from
  it (leaving the run for the moment between), so its counters and sync state go on;
- ``fabric.setup_dataloaders`` gives each rank the run's data rank (rank r of island i of M:
  i + r x M), and counts each batch's tokens for the merge weights as it is drawn;
- ``fabric.strategy.teardown()`` ends the island's run as the end of ``Trainer.fit`` does: it
  waits for the last rounds, loads the global model and leaves the run;
- SIGTERM ends the island's waits, and where the script has no handler of its own the process
  exits (143) after leaving the run (:mod:`~lightning_diloco.learner.sigterm`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_diloco.learner.data import rank_of, split_for, unsplit_iterables, unsplit_warning
from lightning_diloco.learner.island_membership import CHECKPOINT_KEY, IslandMembership

if TYPE_CHECKING:  # mixed in before a Fabric strategy: the type checker sees what it is mixed into
    from lightning.fabric.strategies import ParallelStrategy as _MixedInto
else:
    _MixedInto = object


class FabricIsland(IslandMembership, _MixedInto):
    """A Lightning Fabric strategy's island hooks; the island is :class:`IslandMembership`'s,
    the other half a Fabric strategy."""

    _module: torch.nn.Module | None = None  # the island's module, as its parameters are trained
    _optimizer: Any = None  # the first optimizer set up: its steps are the inner steps

    # ---- joining: once the module and its optimizer are set up -----------------------------------

    def _set_island_module(self, module: torch.nn.Module) -> None:
        """The strategy's ``setup_module`` names the module whose parameters the island trains
        (unwrapped: DDP's inner module; FSDP2's sharded one), until the island has joined."""
        if self.learner is None:
            self._module = module

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = super().setup_optimizer(optimizer)
        if self.learner is None:
            if self._module is None:
                raise RuntimeError("the island joins the run with the module it trains: set up the model before or "
                                   "with its optimizer (fabric.setup(model, optimizer), or fabric.setup_module(model) "
                                   "then fabric.setup_optimizers(optimizer))")
            self._optimizer = optimizer
            self._join()
            self._sigterm.install(self._stop_waits, replace_default=True, leave=self._leave_run)
        return optimizer

    def _island_module(self) -> torch.nn.Module:
        assert self._module is not None, "set by setup_module before the island joins"
        return self._module

    # ---- the inner loop --------------------------------------------------------------------------

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        if self.learner is not None and optimizer is self._optimizer:  # a second optimizer's steps are not inner steps
            self.learner.after_step(self._tokens)
            self._tokens = 0.0
        return output

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        # after Fabric injected the sampler (of distributed_sampler_kwargs: the run's data rank): a
        # Hugging Face iterable dataset is split here for the same rank, any other is the script's
        part = rank_of(self.distributed_sampler_kwargs)
        dataloader = split_for(dataloader, part)  # type: ignore[assignment]  # a DataLoader in, a DataLoader out
        names = unsplit_iterables([dataloader])
        if names and part.world_size > 1 and not self.data_split_by_script:
            from lightning.fabric.utilities.rank_zero import rank_zero_warn

            rank_zero_warn(unsplit_warning(names, self.island, self.num_islands, part))
        return _counting(super().process_dataloader(dataloader), self._count)

    def _count(self, batch: Any) -> None:
        self._tokens += self.count_tokens(batch)

    # ---- checkpoints: fabric.save / fabric.load --------------------------------------------------

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Any] | None = None) -> None:
        if self.learner is not None:
            state = dict(state)  # the outer state (and an FSDP2 island's bases) join the caller's, not in it
            state[CHECKPOINT_KEY] = self._outer_state(state)
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not isinstance(state, dict) or not state:  # the checkpoint read whole, or a raw state dict: nothing resumed
            return remainder
        saved = remainder.pop(CHECKPOINT_KEY, None)
        if saved is not None:
            self._resume = saved
            self._read_bases(path, remainder)
            if self.learner is not None:  # joined at setup, before the weights were restored: again, from them
                self._leave_for_resume()
                self._join()
        return remainder

    def _read_bases(self, path: Any, remainder: dict[str, Any]) -> None:
        """Where a strategy keeps the base fragments apart from the outer state (FSDP2's, sharded),
        it reads them into ``self._resume`` here; ``remainder``: what the checkpoint held besides
        the state asked for."""

    def _leave_for_resume(self) -> None:
        self.learner.close()
        self.learner = None
        if self.embedded is not None:  # restarted from the checkpoint's state by the join
            self.embedded.shutdown()
            self.embedded = None

    # ---- the end ----------------------------------------------------------------------------------

    @override
    def teardown(self) -> None:
        """End the island's run (wait for its last rounds, load the global model, leave the run),
        then Fabric's teardown. Fabric calls no end of training itself: the script calls
        ``fabric.strategy.teardown()`` once its loop is done."""
        self._sigterm.restore()
        if self.learner is not None and self.end_with_global_model:
            self.learner.finish()
        self._leave_run()
        super().teardown()


def _counting(dataloader: DataLoader, count: Any) -> DataLoader:
    """``dataloader`` as it was, but each batch it yields is passed to ``count`` first. A shallow
    copy of another class (the loader's, with that iteration): Fabric wraps what it is given and
    reads its attributes, so a wrapper object would have to be a DataLoader anyway."""
    if not isinstance(dataloader, DataLoader):
        return dataloader
    counted = _COUNTING.get(type(dataloader))
    if counted is None:
        base = type(dataloader)

        def __iter__(self):
            for batch in base.__iter__(self):
                self._count_batch(batch)
                yield batch

        counted = _COUNTING[base] = type(f"Counting{base.__name__}", (base,), {"__iter__": __iter__})
    copy_ = object.__new__(counted)
    copy_.__dict__.update(dataloader.__dict__)
    copy_.__dict__["_count_batch"] = count
    copy_.__dict__["_iterator"] = None  # persistent workers of the original's iterate without counting
    return copy_


_COUNTING: dict[type[DataLoader], type[DataLoader]] = {}
