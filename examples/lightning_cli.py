"""LightningCLI with Decoupled DiLoCo: the tiny Llama of ``train_lm.py``, every setting a flag or
an entry of a ``config.yaml``.

    .venv/bin/python examples/lightning_cli.py fit --trainer.strategy=decoupled_diloco --trainer.max_steps=48

The strategy's own arguments by name take its class path:
``--trainer.strategy=lightning_diloco.DecoupledDiLoCoStrategy --trainer.strategy.sync_every=8``.
Under ``lightning-diloco run`` the island, the synchronizer and the token come from the
environment (``DILOCO_*``), never from a flag, so they are not written into ``config.yaml``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader
from train_lm import LM, BigramLanguage

import lightning_diloco  # noqa: F401  registers "decoupled_diloco"


class TinyLlama(LM):
    """The tiny Llama of ``train_lm.py`` with the arguments a CLI user sets."""

    def __init__(self, vocab: int = 64, hidden: int = 64, layers: int = 2, lr: float = 3e-3) -> None:
        super().__init__(vocab, hidden, layers, lr, step_seconds=0.0)


class BigramData(pl.LightningDataModule):
    """Sequences from a fixed random bigram model (``train_lm.BigramLanguage``)."""

    def __init__(self, vocab: int = 64, seq: int = 32, batch_size: int = 16, samples: int = 4096) -> None:
        super().__init__()
        self.vocab, self.seq, self.batch_size, self.samples = vocab, seq, batch_size, samples

    def train_dataloader(self) -> DataLoader:
        return DataLoader(BigramLanguage(self.samples, self.seq, self.vocab, seed=0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(BigramLanguage(256, self.seq, self.vocab, seed=1), batch_size=self.batch_size)


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab", "model.vocab")  # one vocabulary for both


def main() -> None:
    torch.set_num_threads(1)
    CLI(TinyLlama, BigramData, seed_everything_default=0)


if __name__ == "__main__":
    main()
