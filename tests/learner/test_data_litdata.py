"""LitData across islands, and the warning each kind of data gets when no one split it for the run.

A LitData ``StreamingDataset`` shards itself by the distributed environment it detects: the
island's ranks only, so every island read the same samples. The strategy tells it the run's data
rank instead (learner/data.py). The chunks here are written by LitData's ``BinaryWriter``, which
``litdata.optimize`` writes with, in-process (optimize's worker processes take about 20 s here);
tests/learner/data_table.py writes its with ``optimize`` itself.
"""

from __future__ import annotations

from collections import Counter

import litdata
import pytest
import torch
from litdata.streaming.writer import BinaryWriter
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from lightning_diloco import DecoupledDiLoCoStrategy
from lightning_diloco.learner.data import DataRank, unsplit_data_warnings
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from tests.learner.models import TinyRegressor, trainer
from tests.learner.test_data import CONFIG, _strategy


@pytest.fixture(scope="module")
def chunks(tmp_path_factory) -> str:
    """64 samples {"id": i, "x": 8 floats} in 8 chunks, as litdata.optimize lays them out."""
    out = tmp_path_factory.mktemp("litdata")
    writer = BinaryWriter(str(out), chunk_size=8)
    for i in range(64):
        writer[i] = {"id": i, "x": torch.full((8,), float(i))}
    writer.done()
    writer.merge()
    return str(out)


def test_a_litdata_stream_given_whole_is_sharded_across_islands_and_ranks_each_sample_once_per_epoch(chunks):
    """2 islands x 2 ranks, each building the stream as its process would: each epoch, every
    sample once across the run (LitData alone gave each island all 64), in another order."""
    loaders = {(island, rank): _strategy(island, rank).process_dataloader(
                   DataLoader(litdata.StreamingDataset(chunks, shuffle=True, seed=7), batch_size=4))
               for island in range(2) for rank in range(2)}
    orders = []
    for epoch in range(2):
        parts = {key: [int(i) for batch in loader for i in batch["id"]] for key, loader in loaders.items()}
        assert Counter(i for part in parts.values() for i in part) == Counter(range(64)), epoch
        assert all(len(part) == 16 for part in parts.values()), parts
        orders.append(parts)
    assert all(orders[0][key] != orders[1][key] for key in loaders)  # LitData's own epoch counter reshuffles
    alone = DataLoader(litdata.StreamingDataset(chunks, shuffle=True, seed=7), batch_size=4)
    assert sorted(int(i) for batch in alone for i in batch["id"]) == list(range(64))  # no strategy: all of it


class Numbers(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_each_kind_of_unsplit_data_is_warned_of_with_its_own_fix(chunks):
    """Rank 1 of island 1 of 2 islands x 2 ranks (data rank 3 of 4), its training loaders as the
    strategy sees them: a plain iterable left whole is told to split by data_rank; a map-style one
    whose sampler takes everything, or splits by the island's ranks (DDP's habit), is told to leave
    Lightning's sampler in place or build a DistributedSampler by data_rank; a LitData stream (the
    strategy shards it), a map-style one with the run's sampler, and nothing at one data rank
    are not warned of."""
    part = DataRank(3, 4)
    data = TensorDataset(torch.arange(16))
    stream = _strategy(1, 1).process_dataloader(DataLoader(litdata.StreamingDataset(chunks), batch_size=4))
    the_runs = DataLoader(data, sampler=DistributedSampler(data, num_replicas=4, rank=3))
    assert unsplit_data_warnings([stream, the_runs], 1, 2, part) == []

    plain, everything = DataLoader(Numbers()), DataLoader(data, shuffle=True)
    by_island = DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1))
    warned = unsplit_data_warnings([plain, everything, by_island], 1, 2, part)
    assert len(warned) == 3
    assert "(Numbers) is an IterableDataset" in warned[0] and "lightning_diloco.data_rank(self.trainer)" in warned[0]
    assert "3 of 4 for this process" in warned[0] and "itertools.islice" in warned[0]
    for text in warned[1:]:
        assert "(TensorDataset) is a map-style dataset" in text and "use_distributed_sampler=True" in text
        assert "DistributedSampler(dataset, num_replicas=world_size, rank=rank" in text and "3 of 4" in text
    assert "(RandomSampler) takes every sample" in warned[1]
    assert "(DistributedSampler) takes part 1 of 2, which repeats samples across islands" in warned[2]


class LitDataRegressor(TinyRegressor):
    """Trains on a LitData stream given whole, or on a map-style dataset of its own sampler."""

    def __init__(self, chunks: str | None) -> None:
        super().__init__()
        self.chunks, self.seen = chunks, []

    def train_dataloader(self):
        if self.chunks is not None:
            return DataLoader(litdata.StreamingDataset(self.chunks), batch_size=4)
        ids = torch.arange(32)
        return DataLoader(TensorDataset(ids.float().unsqueeze(1).expand(32, 8), ids.float().unsqueeze(1)), batch_size=4,
                          shuffle=True)

    def training_step(self, batch, batch_idx):
        if isinstance(batch, dict):
            self.seen += batch["id"].tolist()
            batch = (batch["x"], batch["id"].float().unsqueeze(1))
        else:
            self.seen += batch[1].flatten().int().tolist()
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("kind", ["litdata", "map-style, use_distributed_sampler=False"])
def test_island_1_of_2_trains_on_its_half_of_a_litdata_stream_and_is_told_when_its_sampler_is_its_own(kind, chunks,
                                                                                                     recwarn):
    """A real Trainer, island 1 of 2 (one process): the LitData stream given whole trains on its
    half, unwarned; a map-style dataset under use_distributed_sampler=False trains on all 32
    samples, and the warning says how to split it."""
    server = SynchronizerServer(Synchronizer(CONFIG), host="127.0.0.1", port=0).start()
    try:
        module = LitDataRegressor(chunks if kind == "litdata" else None)
        strategy = DecoupledDiLoCoStrategy(synchronizer=server.address, island=1, num_islands=2)
        trainer(strategy, max_epochs=1, use_distributed_sampler=kind == "litdata").fit(module)
    finally:
        server.stop(grace=0)
    warned = [str(w.message) for w in recwarn if str(w.message).startswith("island 1 of 2: the training data")]
    if kind == "litdata":
        assert len(module.seen) == 32 and len(set(module.seen)) == 32 and warned == []
    else:
        assert sorted(module.seen) == list(range(32))
        assert len(warned) == 1 and "(RandomSampler) takes every sample" in warned[0], warned
