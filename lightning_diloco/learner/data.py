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
- a LitData ``StreamingDataset`` shards itself by the distributed environment it detects, which
  is the island's ranks only: it is told the data rank instead, and shards by it as under DDP;
- any other iterable dataset is the user's to split, by :func:`data_rank`; the strategy warns when
  training starts if it was left whole, as it does for a map-style dataset whose sampler is not
  the run's (``Trainer(use_distributed_sampler=False)``, a sampler of the island's ranks).

Neither library is a dependency: each is looked at only if the script has imported it.
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
    unsplit dataset.

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
    for stream in _litdata_streams(dataloader.dataset if isinstance(dataloader, DataLoader) else dataloader):
        _shard_litdata(stream, part)
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


# ---- LitData: told the run's data rank, it shards as it does under DDP -----------------------------


def _litdata_streams(dataset: object) -> list[Any]:
    """The LitData ``StreamingDataset`` s that ``dataset`` iterates: itself, or those a
    ``CombinedStreamingDataset`` / ``ParallelStreamingDataset`` draws from (empty for anything else)."""
    litdata = sys.modules.get("litdata")  # only if the script has imported it, as it has when its dataset is one
    if litdata is None:
        return []
    if isinstance(dataset, litdata.StreamingDataset):
        return [dataset]
    if isinstance(dataset, (litdata.CombinedStreamingDataset, litdata.ParallelStreamingDataset)):
        return [d for d in dataset._datasets if isinstance(d, litdata.StreamingDataset)]
    return []


def _shard_litdata(stream: Any, part: DataRank) -> None:
    """``stream`` (a LitData ``StreamingDataset``) shards for ``part``: what it detected when it was
    built (``torch.distributed``'s group, ``WORLD_SIZE`` / ``GLOBAL_RANK``) is the island's ranks
    only, so every island read the same samples. Set in place, as its own detection sets it: it
    reads the attribute at each ``__iter__`` and ``__len__``, in DataLoader workers too (they get a
    copy of the dataset), and keeps its epoch counter and state dict. One node: LitData's node
    grouping only keeps a node's chunks in its cache across epochs, and an island's data ranks
    (i + r x M) are not contiguous."""
    from litdata.utilities.env import _DistributedEnv

    stream.distributed_env = _DistributedEnv(world_size=part.world_size, global_rank=part.rank, num_nodes=1)


def _with_dataset(dataloader: DataLoader, dataset: Any) -> DataLoader:
    """The same loader (class, batch size, workers, collate function) over another dataset.

    A shallow copy, not Lightning's re-instantiation (which needs the loader's ``__init__``
    arguments and fails on subclasses that do not keep them): an iterable dataset's loader holds
    nothing that depends on the dataset besides the dataset itself."""
    split = copy.copy(dataloader)
    object.__setattr__(split, "dataset", dataset)  # DataLoader refuses a new dataset after __init__
    split._iterator = None  # persistent workers of the original's iterate the whole dataset
    return split


# ---- what no one split: a warning that names the fix for its kind --------------------------------


def unsplit_data_warnings(dataloaders: list[object], island: int, num_islands: int, part: DataRank) -> list[str]:
    """One warning for each of ``dataloaders`` (an island's training loaders, once the strategy
    processed them) whose data every island would train on whole or by the island's ranks only:
    a plain iterable dataset no one split, or a map-style one whose sampler is not the run's.
    Hugging Face and LitData iterables are split by the strategy (a Hugging Face one split by
    other numbers is warned of where it is met: :func:`_split_hf`)."""
    where = f"island {island} of {num_islands}"
    ask = ("`rank, world_size = lightning_diloco.data_rank(self.trainer)` in train_dataloader() "
           f"({part.rank} of {part.world_size} for this process; rank r of this island is {island} + r x {num_islands})")
    warnings = []
    for loader in dataloaders:
        dataset = loader.dataset if isinstance(loader, DataLoader) else loader
        name = type(dataset).__name__
        if isinstance(dataset, IterableDataset):
            if not _is_hf_iterable(dataset) and not _litdata_streams(dataset):
                warnings.append(
                    f"{where}: the training data ({name}) is an IterableDataset, which Lightning hands whole to "
                    f"every rank: every island trains on the same samples. Split it by the run's data rank: {ask}, "
                    "then e.g. files[rank::world_size] or itertools.islice(samples, rank, None, world_size) "
                    "(docs/lightning.md#data-one-shard-per-island). trainer.global_rank and trainer.world_size count "
                    "this island's ranks only: splitting by them repeats the data on every island.")
        elif isinstance(loader, DataLoader):
            sampler = _sampler_of(loader)
            split = (getattr(sampler, "rank", None), getattr(sampler, "num_replicas", None))
            if split != tuple(part):
                by = ("takes every sample" if split[1] is None
                      else f"takes part {split[0]} of {split[1]}, which repeats samples across islands")
                warnings.append(
                    f"{where}: the training data ({name}) is a map-style dataset whose loader's sampler "
                    f"({type(sampler).__name__}) {by}: every island trains on the same samples. Leave "
                    "Trainer(use_distributed_sampler=True) (the default) and give the loader no sampler of your "
                    "own, or shuffle=True: Lightning gives it the run's, by data rank; or build it yourself: "
                    f"{ask}, then DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=<the same "
                    "on every island>) (docs/lightning.md#data-one-shard-per-island).")
    return warnings


def _sampler_of(loader: DataLoader) -> object:
    """The sampler that picks ``loader``'s samples: its batch sampler's, if that has one (Lightning
    injects its distributed sampler there when the loader was given a batch sampler)."""
    inner = getattr(loader.batch_sampler, "sampler", None)
    return inner if inner is not None else loader.sampler
