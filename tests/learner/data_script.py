"""One island of tests/learner/data_table.py's run: `python data_script.py OUT JSONL LITDATA` with
DILOCO_* set, 2 DDP ranks, 3 epochs.

Trains on every kind of dataset at once, each the way a user would write it (KINDS): a map-style
dataset (Lightning's sampler), a Hugging Face stream of the local JSON lines file JSONL given
whole and shuffled (``set_epoch`` called each epoch, as Hugging Face documents it), a LitData
``StreamingDataset`` of the chunks in LITDATA given whole, and a plain ``IterableDataset`` split by
``lightning_diloco.data_rank``, by DDP's ``trainer.global_rank`` of ``trainer.world_size``, and
left whole. Writes the sample ids each rank saw, per epoch and kind, and its data rank to
OUT/rank{R}.pt.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

torch.set_num_threads(1)

import datasets  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import litdata  # noqa: E402
from lightning.pytorch.utilities import CombinedLoader  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset  # noqa: E402

import lightning_diloco  # noqa: E402
from lightning_diloco import DecoupledDiLoCoStrategy  # noqa: E402
from lightning_diloco.learner.collective import leave_process_group  # noqa: E402
from tests.helpers import exit_now  # noqa: E402
from tests.learner.models import trainer  # noqa: E402

SAMPLES = 64  # of each kind; ids 0..63 everywhere
KINDS = ("map-style", "hf", "litdata", "plain, data_rank", "plain, global_rank", "plain, whole")
EPOCHS = 3


class Ids(Dataset):
    """Map-style: sample i is i."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return i


class Numbers(IterableDataset):
    """A stream of ids 0..63, part ``rank`` of ``world_size`` of it."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank, self.world_size = rank, world_size

    def __iter__(self):
        return iter(range(self.rank, SAMPLES, self.world_size))


class Recorder(pl.LightningModule):
    def __init__(self, jsonl: str, chunks: str) -> None:
        super().__init__()
        self.jsonl, self.chunks = jsonl, chunks
        self.net = nn.Linear(1, 1)
        self.seen: dict[str, list[list[int]]] = {kind: [] for kind in KINDS}

    def train_dataloader(self):
        self.hf = datasets.load_dataset("json", data_files=self.jsonl, split="train", streaming=True)
        self.hf = self.hf.shuffle(seed=5, buffer_size=SAMPLES)  # one seed on every island
        rank, world_size = lightning_diloco.data_rank(self.trainer)
        loaders = {
            "map-style": DataLoader(Ids(), batch_size=4, shuffle=True),
            "hf": DataLoader(self.hf, batch_size=4),
            "litdata": DataLoader(litdata.StreamingDataset(self.chunks, shuffle=True, seed=5), batch_size=4),
            "plain, data_rank": DataLoader(Numbers(rank, world_size), batch_size=4),
            "plain, global_rank": DataLoader(Numbers(self.trainer.global_rank, self.trainer.world_size), batch_size=4),
            "plain, whole": DataLoader(Numbers(), batch_size=4),
        }
        return CombinedLoader(loaders, mode="max_size")  # each to its end: the whole one is the longest

    def on_train_epoch_start(self):
        self.hf.set_epoch(self.current_epoch)  # as Hugging Face documents it, on the dataset given
        for ids in self.seen.values():
            ids.append([])

    def training_step(self, batch, batch_idx):
        for kind, part in batch.items():
            if part is not None:  # max_size: None once that kind's epoch has ended
                self.seen[kind][-1] += (part["id"] if isinstance(part, dict) else part).tolist()
        x = torch.tensor([[float(batch_idx)]])
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    out, jsonl, chunks = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    strategy = DecoupledDiLoCoStrategy(sync_every=4, num_fragments=2, overlap_steps=1, uplink_codec="fp32", downlink_codec="fp32")
    module = Recorder(jsonl, chunks)
    island = trainer(strategy, devices=2, max_epochs=EPOCHS)
    island.fit(module)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"seen": module.seen, "data_rank": tuple(lightning_diloco.data_rank(island))}, out / f"rank{island.global_rank}.pt")
    leave_process_group()


if __name__ == "__main__":
    main()
    exit_now()
