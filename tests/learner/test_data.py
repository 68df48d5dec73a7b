"""Iterable datasets across islands: every rank of every island takes its own part of the data.

A map-style dataset is split by Lightning's DistributedSampler (test_strategy.py); an iterable one
has no sampler: a Hugging Face one is split by the strategy, a plain one by the script through
lightning_diloco.data_rank, and one left whole is warned about when training starts.
"""

from __future__ import annotations

import datasets
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import lightning_diloco
from lightning_diloco import DecoupledDiLoCoStrategy
from lightning_diloco.core.config import CodecConfig, RunConfig, ScheduleConfig
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from tests.learner.models import TinyRegressor, trainer

CONFIG = RunConfig(schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1),
                   codec=CodecConfig(uplink="fp32", downlink="fp32"))


def _strategy(island: int, rank: int, num_islands: int = 2, ranks: int = 2) -> DecoupledDiLoCoStrategy:
    """Rank ``rank`` of island ``island`` as it stands once its processes have started."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    strategy = DecoupledDiLoCoStrategy(synchronizer="127.0.0.1:1", island=island, num_islands=num_islands)
    strategy.parallel_devices = [torch.device("cpu")] * ranks
    strategy.cluster_environment = LightningEnvironment()
    strategy.cluster_environment.set_global_rank(rank)
    return strategy


def _ids(loader) -> list[int]:
    return [int(i) for batch in loader for i in batch["id"]]


def test_a_hugging_face_iterable_dataset_is_split_across_islands_and_ranks():
    """Given whole, as a DataLoader's dataset or as the loader itself: the 2 x 2 ranks take
    disjoint quarters, i + r x M of M x W as the sampler would, and the loader keeps its batches."""
    stream = datasets.IterableDataset.from_generator(lambda: ({"id": i} for i in range(40)))
    parts = {}
    for island in range(2):
        for rank in range(2):
            strategy = _strategy(island, rank)
            loader = strategy.process_dataloader(DataLoader(stream, batch_size=4))
            assert loader.batch_size == 4
            parts[island, rank] = _ids(loader)
            assert [row["id"] for row in strategy.process_dataloader(stream)] == parts[island, rank]
    assert parts[1, 0] == list(range(1, 40, 4)) and parts[0, 1] == list(range(2, 40, 4))
    assert sorted(sum(parts.values(), [])) == list(range(40))  # each sample once
    assert _ids(DataLoader(stream, batch_size=4)) == list(range(40))  # the user's own loader stays whole


def test_set_epoch_on_the_hugging_face_dataset_given_reshuffles_each_islands_part_and_they_stay_disjoint():
    """The strategy trains on a split copy: ds.set_epoch(e), as Hugging Face documents it, had no
    effect on it, and every epoch repeated epoch 0's order. Over 3 epochs, 2 islands."""
    stream = datasets.IterableDataset.from_generator(lambda: ({"id": i} for i in range(64))).shuffle(seed=0, buffer_size=64)
    loaders = [_strategy(island, 0, ranks=1).process_dataloader(DataLoader(stream, batch_size=4)) for island in range(2)]
    epochs = []
    for epoch in range(3):
        stream.set_epoch(epoch)
        parts = [_ids(loader) for loader in loaders]
        assert sorted(parts[0] + parts[1]) == list(range(64)), epoch  # each sample once, across the islands
        epochs.append(parts)
    for island in range(2):
        orders = [tuple(parts[island]) for parts in epochs]
        assert len(set(orders)) == 3, island  # each epoch in another order


def test_a_hugging_face_dataset_split_by_the_ddp_ranks_is_named():
    """The DDP habit, split_dataset_by_node(ds, trainer.global_rank, trainer.world_size), repeats
    each island's part on the other: the strategy says so, and does not split it a second time."""
    from datasets.distributed import split_dataset_by_node

    stream = datasets.IterableDataset.from_generator(lambda: ({"id": i} for i in range(40)))
    by_island_ranks = split_dataset_by_node(stream, rank=0, world_size=2)
    with pytest.warns(UserWarning, match=r"split for rank 0 of 2, which repeats samples across islands.*1 of 4"):
        loader = _strategy(1, 0).process_dataloader(DataLoader(by_island_ranks, batch_size=4))
    assert _ids(loader) == list(range(0, 40, 2))


class Numbers(IterableDataset):
    def __init__(self, n: int, rank: int = 0, world_size: int = 1) -> None:
        self.n, self.rank, self.world_size = n, rank, world_size

    def __iter__(self):
        for i in range(self.rank, self.n, self.world_size):
            yield torch.full((8,), float(i)), torch.tensor([float(i)])


class Recorder(TinyRegressor):
    def __init__(self, split: bool) -> None:
        super().__init__()
        self.split, self.seen = split, []

    def train_dataloader(self):
        rank, world_size = lightning_diloco.data_rank(self.trainer) if self.split else (0, 1)
        return DataLoader(Numbers(32, rank, world_size), batch_size=4)

    def training_step(self, batch, batch_idx):
        self.seen += batch[1].flatten().int().tolist()
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("split", [False, True])
def test_a_plain_iterable_dataset_left_whole_is_warned_of_and_data_rank_splits_it(split, recwarn):
    """Island 1 of 2 (one process): left whole, it trains on every sample, as island 0 would,
    and is told its data rank; split by data_rank, it takes the odd samples and is told nothing."""
    server = SynchronizerServer(Synchronizer(CONFIG), host="127.0.0.1", port=0).start()
    try:
        module = Recorder(split)
        trainer(DecoupledDiLoCoStrategy(synchronizer=server.address, island=1, num_islands=2), max_epochs=1).fit(module)
    finally:
        server.stop(grace=0)
    warned = [str(w.message) for w in recwarn if "IterableDataset" in str(w.message)]
    if split:
        assert module.seen == list(range(1, 32, 2)) and warned == []
    else:
        assert module.seen == list(range(32))
        assert len(warned) == 1 and "island 1 of 2" in warned[0] and "1 of 2 for this process" in warned[0], warned
        assert "lightning_diloco.data_rank(self.trainer)" in warned[0] and "(Numbers)" in warned[0]


@pytest.mark.slow
def test_two_islands_of_two_ranks_see_every_sample_once_per_epoch_of_each_kind_split_for_the_run(tmp_path):
    """docs/lightning.md's table (tests/learner/data_table.py), 2 islands x 2 DDP ranks, 3 epochs:
    a map-style dataset, a Hugging Face stream and a LitData stream given whole, and a plain
    IterableDataset split by data_rank see each sample once per epoch across the run, the first
    three in another order each epoch; split by the island's ranks or left whole, it repeats."""
    from tests.learner.data_table import figures, measure, table

    run = measure(tmp_path)
    assert not any("the training data" in out for out in run["outputs"])  # the script asked data_rank: no warning
    ranks = run["ranks"]
    assert {key: rank["data_rank"] for key, rank in ranks.items()} == {(0, 0): (0, 4), (1, 0): (1, 4), (0, 1): (2, 4), (1, 1): (3, 4)}
    rows = figures(ranks)
    print(table(rows))
    for kind in ("map-style", "hf", "litdata", "plain, data_rank"):
        assert rows[kind]["per island"] == [32, 32] and rows[kind]["each once"], (kind, rows[kind])
        assert rows[kind]["order changes"] == (kind != "plain, data_rank"), (kind, rows[kind])
    assert rows["plain, global_rank"]["in total"] == 128 and rows["plain, whole"]["in total"] == 256
    assert not rows["plain, global_rank"]["each once"] and rows["plain, whole"]["distinct"] == 64
