"""One island of test_data.py's run: `python data_script.py OUT JSONL` with DILOCO_* set, 2 DDP ranks.

Trains on two iterable datasets at once: a Hugging Face one streamed from the local JSON lines
file JSONL, given to the trainer whole (the strategy splits it), and a plain IterableDataset the
module splits itself by ``lightning_diloco.data_rank``. Writes the sample ids each rank saw, per
epoch and dataset, and its data rank to OUT/rank{R}.pt.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

torch.set_num_threads(1)

import datasets  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.utilities import CombinedLoader  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402

import lightning_diloco  # noqa: E402
from lightning_diloco import DecoupledDiLoCoStrategy  # noqa: E402
from lightning_diloco.learner.collective import leave_process_group  # noqa: E402
from tests.helpers import exit_now  # noqa: E402
from tests.learner.models import trainer  # noqa: E402

PLAIN_IDS = range(1000, 1064)


class Numbers(IterableDataset):
    """A stream the script splits itself: part ``rank`` of ``world_size``."""

    def __init__(self, ids, rank: int, world_size: int) -> None:
        self.ids, self.rank, self.world_size = list(ids), rank, world_size

    def __iter__(self):
        return iter(self.ids[self.rank::self.world_size])


class Recorder(pl.LightningModule):
    def __init__(self, jsonl: str) -> None:
        super().__init__()
        self.jsonl = jsonl
        self.net = nn.Linear(1, 1)
        self.seen: dict[str, list[list[int]]] = {"hf": [], "plain": []}

    def train_dataloader(self):
        hf = datasets.load_dataset("json", data_files=self.jsonl, split="train", streaming=True)
        rank, world_size = lightning_diloco.data_rank(self.trainer)
        loaders = {"hf": DataLoader(hf, batch_size=4), "plain": DataLoader(Numbers(PLAIN_IDS, rank, world_size), batch_size=4)}
        return CombinedLoader(loaders, mode="min_size")  # the two are as long: both end together

    def on_train_epoch_start(self):
        for ids in self.seen.values():
            ids.append([])

    def training_step(self, batch, batch_idx):
        self.seen["hf"][-1] += batch["hf"]["id"].tolist()
        self.seen["plain"][-1] += batch["plain"].tolist()
        x = torch.cat([batch["hf"]["x"], batch["plain"]]).float().unsqueeze(1) / 1000
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def main() -> None:
    out, jsonl = Path(sys.argv[1]), sys.argv[2]
    strategy = DecoupledDiLoCoStrategy(sync_every=4, num_fragments=2, overlap_steps=1, uplink_codec="fp32", downlink_codec="fp32")
    module = Recorder(jsonl)
    island = trainer(strategy, devices=2, max_epochs=2)
    island.fit(module)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"seen": module.seen, "data_rank": tuple(lightning_diloco.data_rank(island))}, out / f"rank{island.global_rank}.pt")
    leave_process_group()


if __name__ == "__main__":
    main()
    exit_now()
