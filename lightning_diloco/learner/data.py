"""Each rank of each island takes its own part of the run's data, whatever the dataset.

Rank r of island i (M islands, W ranks each) is data rank i + r x M of M x W: the one definition
is :meth:`~lightning_diloco.learner.island_membership.IslandMembership.sampler_kwargs`,
which Lightning's ``DistributedSampler`` takes for a map-style dataset. An iterable dataset has no
sampler, and Lightning hands it whole to every rank: every island would train on the same samples
in the same order, and the usual DDP habit (splitting by ``trainer.global_rank`` of
``trainer.world_size``) would still repeat each island's part on every other island, since each
island's ranks count from 0. So:

- a Hugging Face ``datasets.IterableDataset`` is split here for the data rank, as the sampler
  splits a map-style dataset (``datasets`` is looked at only if the user's dataset is one of its);
- any other iterable dataset is the user's to split, by :func:`data_rank`; the strategy warns when
  training starts if it was left whole.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset

__all__ = ["DataRank", "data_rank"]


class DataRank(NamedTuple):
    """This process's part of the run's data: part ``rank`` of ``world_size`` equal parts."""

    rank: int
    world_size: int


def data_rank(trainer: Any) -> DataRank:
    """The part of the run's data this process trains on: across islands and their ranks.

    Rank r of island i of a run of M islands of W ranks is ``DataRank(i + r * M, M * W)``; under
    any other strategy, Lightning's own (``DataRank(global_rank, world_size)`` for DDP,
    ``DataRank(0, 1)`` for one device), so the same code runs with or without Decoupled DiLoCo.
    Ask for it once the trainer has started (in ``setup()`` or ``train_dataloader()``; with
    Fabric, after ``fabric.launch()``), and split an iterable dataset by it, e.g.
    ``files[rank::world_size]``, or ``itertools.islice(samples, rank, None, world_size)``. Asking
    also tells the strategy that the script splits its data itself: it no longer warns about an
    unsplit iterable dataset.

    Args:
        trainer: The ``lightning.pytorch.Trainer`` (``self.trainer`` in a module or datamodule),
            or the ``lightning.fabric.Fabric``.
    """
    strategy = trainer.strategy
    island = vars(strategy).get("diloco")  # an island strategy's island (learner/island_membership.py)
    if island is not None:
        island.data_split_by_script = True
    if hasattr(trainer, "distributed_sampler_kwargs"):  # a Trainer's: None unless its strategy is a parallel one
        return rank_of(trainer.distributed_sampler_kwargs)
    return rank_of(getattr(strategy, "distributed_sampler_kwargs", None))  # Fabric's strategy, whatever it is


def rank_of(sampler_kwargs: dict[str, Any] | None) -> DataRank:
    """A strategy's ``distributed_sampler_kwargs`` (None without one) as a :class:`DataRank`."""
    if sampler_kwargs is None:
        return DataRank(0, 1)
    return DataRank(sampler_kwargs["rank"], sampler_kwargs["num_replicas"])


# ---- Hugging Face iterable datasets: split as the sampler splits a map-style one -----------------


def split_for(dataloader: object, part: DataRank) -> object:
    """``dataloader`` with its Hugging Face ``IterableDataset`` (or itself, if it is one) split for
    ``part``; anything else unchanged."""
    if part.world_size == 1:
        return dataloader
    if _is_hf_iterable(dataloader):
        return _split_hf(dataloader, part)
    if isinstance(dataloader, DataLoader) and _is_hf_iterable(dataloader.dataset):
        return _with_dataset(dataloader, _split_hf(dataloader.dataset, part))
    return dataloader


def _is_hf_iterable(obj: object) -> bool:
    # only if the script has imported `datasets`, as it has when its dataset is one: no dependency
    hf = sys.modules.get("datasets")
    return hf is not None and isinstance(obj, hf.IterableDataset)


def _split_hf(dataset: Any, part: DataRank) -> Any:
    from datasets.distributed import split_dataset_by_node

    done = getattr(dataset, "_distributed", None)  # set by split_dataset_by_node
    if done is None:
        split = split_dataset_by_node(dataset, rank=part.rank, world_size=part.world_size)
        return _sharing_epoch(split, dataset)
    if (done.rank, done.world_size) != tuple(part):
        # the script split it already, by other numbers: a second split would leave too little, and
        # the first one (DDP's ranks, most often) repeats each island's part on the other islands
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"the Hugging Face dataset was split for rank {done.rank} of {done.world_size}, which "
                       f"repeats samples across islands: split it by lightning_diloco.data_rank(trainer) "
                       f"({part.rank} of {part.world_size} here), or leave it whole and the strategy splits it")
    return dataset


def _sharing_epoch(split: Any, dataset: Any) -> Any:
    """``split`` reading its epoch from ``dataset``'s counter: ``dataset.set_epoch(e)``, as Hugging
    Face documents it for each epoch of a shuffled stream, reshuffles the split the loader
    iterates (a copy with a counter of its own otherwise: every epoch repeated epoch 0's order).
    The counter is a tensor in shared memory that ``set_epoch`` updates in place (datasets >= 2.x),
    so persistent workers see it too; a dataset without one keeps the copy's own."""
    epoch = getattr(dataset, "_epoch", None)
    if isinstance(epoch, torch.Tensor):
        split._epoch = epoch
    return split


def _with_dataset(dataloader: DataLoader, dataset: Any) -> DataLoader:
    """The same loader (class, batch size, workers, collate function) over another dataset.

    A shallow copy, not Lightning's re-instantiation (which needs the loader's ``__init__``
    arguments and fails on subclasses that do not keep them): an iterable dataset's loader holds
    nothing that depends on the dataset besides the dataset itself."""
    split = copy.copy(dataloader)
    object.__setattr__(split, "dataset", dataset)  # DataLoader refuses a new dataset after __init__
    split._iterator = None  # persistent workers of the original's iterate the whole dataset
    return split


# ---- any other iterable dataset: the script splits it ---------------------------------------------


def unsplit_iterables(dataloaders: list[object]) -> list[str]:
    """The type names of the iterable datasets among ``dataloaders`` that no one split for the run
    (the strategy splits Hugging Face ones: it has done so by the time training starts)."""
    names = []
    for loader in dataloaders:
        dataset = loader.dataset if isinstance(loader, DataLoader) else loader
        if isinstance(dataset, IterableDataset) and not _is_hf_iterable(dataset):
            names.append(type(dataset).__name__)
    return names


def unsplit_warning(names: list[str], island: int, num_islands: int, part: DataRank) -> str:
    return (
        f"island {island} of {num_islands}: the training data ({', '.join(names)}) is an IterableDataset, which "
        f"Lightning hands whole to every rank: every island trains on the same samples. Split it by the run's data "
        f"rank, {part.rank} of {part.world_size} for this process (rank r of this island: {island} + r x "
        f"{num_islands}): `rank, world_size = lightning_diloco.data_rank(self.trainer)` in train_dataloader(), "
        "then e.g. files[rank::world_size] or itertools.islice(samples, rank, None, world_size) "
        "(docs/lightning.md#data-one-shard-per-island). trainer.global_rank and trainer.world_size count "
        "this island's ranks only: splitting by them repeats the data on every island."
    )
