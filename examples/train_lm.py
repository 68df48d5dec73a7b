"""A tiny Llama learning a synthetic language, as an island of `lightning-diloco run`.

    lightning-diloco run --islands 3 -- python examples/train_lm.py --steps 300

Reads the launcher's environment: DILOCO_STRATEGY (decoupled_diloco, or ddp for the baseline),
DILOCO_DEVICES, DILOCO_NUM_NODES, DILOCO_CHECKPOINT_DIR (a restarted island, and the DDP
baseline, resume from their last checkpoint there).
The data: sequences from a fixed random bigram model, so there is structure to learn and an
eval loss floor (the chain's entropy) to approach.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

import lightning_diloco  # noqa: F401  registers "decoupled_diloco"
from lightning_diloco.launch.progress import ProgressFile
from lightning_diloco.learner.collective import leave_process_group


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
    def __init__(self, vocab: int, hidden: int, layers: int, lr: float, step_seconds: float, slow_unit: int = -1,
                 slowdown: float = 1.0) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        ))
        self.lr, self.step_seconds = lr, step_seconds
        self.slow_unit, self.slowdown = slow_unit, slowdown

    def training_step(self, batch, batch_idx):
        if self.step_seconds:
            # the straggler: island slow_unit (DDP: rank slow_unit) takes slowdown x as long
            unit = self.trainer.global_rank if os.environ.get("DILOCO_STRATEGY") == "ddp" else int(os.environ.get("DILOCO_ISLAND", "0"))
            time.sleep(self.step_seconds * (self.slowdown if unit == self.slow_unit else 1.0))  # emulate a bigger model
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LossCurve(Callback):
    """Every ``every`` steps, rank 0 appends (step, seconds since training started, validation
    loss of the global model) to ``path``: time-to-target-loss for benchmarks/wan.py."""

    def __init__(self, val: Dataset, every: int, path: str, batch: int) -> None:
        self.loader, self.every, self.path = DataLoader(val, batch_size=batch), every, Path(path)
        self.t0 = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self.t0 = time.monotonic()
        if trainer.global_rank == 0:
            self.path.write_text("step,seconds,val_loss\n")

    @torch.no_grad()
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.global_rank != 0 or (step % self.every and step != trainer.max_steps):
            return
        seconds = time.monotonic() - self.t0
        learner = getattr(trainer.strategy, "learner", None)
        with learner.global_weights() if learner is not None else contextlib.nullcontext():
            losses = [pl_module.model(input_ids=b["input_ids"], labels=b["input_ids"]).loss.item() for b in self.loader]
        with self.path.open("a") as f:
            f.write(f"{step},{seconds:.3f},{sum(losses) / len(losses):.5f}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--accelerator", default="cpu", help="cpu, or cuda: every island of a host on its one GPU (benchmarks/gpu.py)")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="extra sleep per step")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints under the launcher")
    parser.add_argument("--slow-unit", type=int, default=-1, help="island (DDP: rank) whose emulated steps take --slowdown x as long")
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--independent", action="store_true", help="train without any synchronization (plain Lightning)")
    parser.add_argument("--result", help="write the final validation loss here (JSON)")
    parser.add_argument("--curve", help="append (step, seconds, val_loss) rows here every --eval-every steps")
    parser.add_argument("--eval-every", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)

    strategy = "auto" if args.independent else os.environ.get("DILOCO_STRATEGY", "decoupled_diloco")
    devices = int(os.environ.get("DILOCO_DEVICES", "1"))
    num_nodes = int(os.environ.get("DILOCO_NUM_NODES", "1"))  # ranks started one per network namespace
    ckpt_dir = os.environ.get("DILOCO_CHECKPOINT_DIR")
    callbacks = [ProgressFile()]
    ckpt_path = None
    if ckpt_dir and strategy != "auto":  # a killed island (or the DDP baseline) resumes from its last checkpoint
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=args.checkpoint_every))
        last = Path(ckpt_dir) / "last.ckpt"
        ckpt_path = str(last) if last.exists() else None
    train = BigramLanguage(4096, args.seq, args.vocab, seed=0)
    val = BigramLanguage(256, args.seq, args.vocab, seed=1)
    if args.curve:
        callbacks.append(LossCurve(val, args.eval_every, args.curve, args.batch))
    trainer = pl.Trainer(
        strategy=strategy, accelerator=args.accelerator, devices=devices, num_nodes=num_nodes, max_steps=args.steps, logger=False,
        enable_checkpointing=bool(ckpt_dir) and strategy != "auto", enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, val_check_interval=None, check_val_every_n_epoch=None,
        limit_val_batches=8, num_sanity_val_steps=0,
    )
    model = LM(args.vocab, args.hidden, args.layers, args.lr, args.step_seconds, args.slow_unit, args.slowdown)
    trainer.fit(model, DataLoader(train, batch_size=args.batch, shuffle=True), ckpt_path=ckpt_path)
    result = trainer.validate(model, DataLoader(val, batch_size=args.batch), verbose=False)[0]
    if trainer.is_global_zero:
        print(f"final val_loss {result['val_loss']:.4f} after {trainer.global_step} steps", flush=True)
        if args.result:
            Path(args.result).write_text(f'{{"val_loss": {result["val_loss"]}, "steps": {trainer.global_step}}}')
    leave_process_group()  # every rank together: a lone exit was seen to abort its peer under load


if __name__ == "__main__":
    main()
