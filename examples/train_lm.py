"""A tiny Llama learning a synthetic language, as an island of `lightning-diloco run`.

    lightning-diloco run --islands 3 -- python examples/train_lm.py --steps 300

Reads the launcher's environment: DILOCO_STRATEGY (decoupled_diloco, or ddp for the baseline),
DILOCO_DEVICES, DILOCO_CHECKPOINT_DIR (the DDP baseline resumes from its last checkpoint there).
The data: sequences from a fixed random bigram model, so there is structure to learn and an
eval loss floor (the chain's entropy) to approach.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import lightning_diloco  # noqa: F401  registers "decoupled_diloco"
from lightning_diloco.launch.progress import ProgressFile


class BigramLanguage(Dataset):
    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0) -> None:
        chain = torch.Generator().manual_seed(1234)  # one language for every split
        probs = torch.softmax(torch.randn(vocab, vocab, generator=chain) * 3.0, dim=-1)
        g = torch.Generator().manual_seed(seed)  # the split's own samples
        tokens = torch.empty(n, seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for t in range(1, seq):
            tokens[:, t] = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=g).squeeze(1)
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i]}


class LM(pl.LightningModule):
    def __init__(self, vocab: int, hidden: int, layers: int, lr: float, step_seconds: float) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        ))
        self.lr, self.step_seconds = lr, step_seconds

    def training_step(self, batch, batch_idx):
        if self.step_seconds:
            time.sleep(self.step_seconds)  # emulate a bigger model's step time
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="extra sleep per step")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="DDP baseline: steps between checkpoints")
    parser.add_argument("--result", help="write the final validation loss here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    strategy = os.environ.get("DILOCO_STRATEGY", "decoupled_diloco")
    devices = int(os.environ.get("DILOCO_DEVICES", "1"))
    ckpt_dir = os.environ.get("DILOCO_CHECKPOINT_DIR")
    callbacks = [ProgressFile()]
    ckpt_path = None
    if strategy == "ddp" and ckpt_dir:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=args.checkpoint_every))
        last = Path(ckpt_dir) / "last.ckpt"
        ckpt_path = str(last) if last.exists() else None
    train = BigramLanguage(4096, args.seq, args.vocab, seed=0)
    val = BigramLanguage(256, args.seq, args.vocab, seed=1)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=args.steps, logger=False,
        enable_checkpointing=ckpt_path is not None or strategy == "ddp", enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, val_check_interval=None, check_val_every_n_epoch=None,
        limit_val_batches=8, num_sanity_val_steps=0,
    )
    model = LM(args.vocab, args.hidden, args.layers, args.lr, args.step_seconds)
    trainer.fit(model, DataLoader(train, batch_size=args.batch, shuffle=True), ckpt_path=ckpt_path)
    result = trainer.validate(model, DataLoader(val, batch_size=args.batch), verbose=False)[0]
    if trainer.is_global_zero:
        print(f"final val_loss {result['val_loss']:.4f} after {trainer.global_step} steps", flush=True)
        if args.result:
            Path(args.result).write_text(f'{{"val_loss": {result["val_loss"]}, "steps": {trainer.global_step}}}')


if __name__ == "__main__":
    main()
