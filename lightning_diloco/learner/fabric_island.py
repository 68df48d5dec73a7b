"""What makes a Lightning Fabric strategy a learner island, whatever its inner parallelism.

:class:`FabricIsland` is the island a Fabric strategy holds (DDP:
:mod:`~lightning_diloco.learner.fabric_strategy`; FSDP2:
:mod:`~lightning_diloco.learner.fabric_fsdp_strategy`), as
:class:`~lightning_diloco.learner.island_strategy.TrainerIsland` is a Trainer's. It maps the
island (:class:`~lightning_diloco.learner.island_membership.IslandMembership`) onto Fabric's
calls, which are the training loop's only hooks:

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

from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_diloco.learner.data import rank_of, split_for
from lightning_diloco.learner.island_membership import CHECKPOINT_KEY, IslandMembership


class FabricIsland(IslandMembership):
    """An island as a Lightning Fabric strategy drives it (``host``: that strategy)."""

    module: torch.nn.Module | None = None  # the island's module, as its parameters are trained
    optimizer: Any = None  # the first optimizer set up: its steps are the inner steps

    def set_module(self, module: torch.nn.Module) -> None:
        """The strategy's ``setup_module`` names the module whose parameters the island trains
        (unwrapped: DDP's inner module; FSDP2's sharded one), until the island has joined."""
        if self.learner is None:
            self.module = module

    def after_setup_optimizer(self, optimizer: Any) -> None:
        """The first optimizer set up joins the run, with the module set up before it."""
        if self.learner is not None:
            return
        if self.module is None:
            raise RuntimeError("the island joins the run with the module it trains: set up the model before or "
                               "with its optimizer (fabric.setup(model, optimizer), or fabric.setup_module(model) "
                               "then fabric.setup_optimizers(optimizer))")
        self.optimizer = optimizer
        self.join(self.module)
        self.sigterm.install(self.stop_waits, replace_default=True, leave=self.leave_run)

    def after_optimizer_step(self, optimizer: Any) -> None:
        if self.learner is not None and optimizer is self.optimizer:  # a second optimizer's steps are not inner steps
            self.after_step()

    def split(self, dataloader: DataLoader) -> DataLoader:
        """Before Fabric's own processing, after it injected the sampler (of
        ``distributed_sampler_kwargs``: the run's data rank): a Hugging Face iterable dataset is
        split here for the same rank, any other is the script's."""
        part = rank_of(self.host.distributed_sampler_kwargs)
        dataloader = split_for(dataloader, part)  # type: ignore[assignment]  # a DataLoader in, a DataLoader out
        self.warn_of_unsplit_data([dataloader], part)
        return dataloader

    def counting(self, dataloader: DataLoader) -> DataLoader:
        """After Fabric's processing: each batch drawn is counted for the merge weights."""
        return _counting(dataloader, self.count)

    def save(self, state: dict[str, Any], learner_state: dict | None = None) -> dict[str, Any]:
        """The state to save: the caller's, and the island's outer state beside it (not in it)."""
        return {**state, CHECKPOINT_KEY: self.outer_state(learner_state)} if self.learner is not None else state

    def load(self, state: Any, remainder: dict[str, Any]) -> bool:
        """Take the outer state from what ``fabric.load(path, state)`` left (``remainder``);
        whether there was some (a strategy then reads what it keeps apart, and calls
        :meth:`rejoin`)."""
        if not isinstance(state, dict) or not state:  # the checkpoint read whole, or a raw state dict: nothing resumed
            return False
        saved = remainder.pop(CHECKPOINT_KEY, None)
        if saved is not None:
            self.resume = saved
        return saved is not None

    def rejoin(self) -> None:
        """An island that had already joined (at setup, before the weights were restored) leaves
        the run for a moment and joins again from the restored state: its counters and sync
        state go on."""
        if self.learner is None:
            return
        self.learner.close()
        self.learner = None
        if self.embedded is not None:  # restarted from the checkpoint's state by the join
            self.embedded.shutdown()
            self.embedded = None
        assert self.module is not None, "the island joined with its module (after_setup_optimizer), kept since"
        self.join(self.module)

    def teardown(self) -> None:
        """End the island's run (wait for its last rounds, load the global model, leave the run).
        Fabric calls no end of training itself: the script calls ``fabric.strategy.teardown()``
        once its loop is done."""
        self.sigterm.restore()
        self.finish()
        self.leave_run()


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
