"""The README's model and the docs' Fabric loop as a user runs them, saved, killed and resumed:
`python resume_script.py trainer|fabric DIR STEPS [--kill-at K] [--resume]`.

``--kill-at K``: the process dies (``os._exit``, no teardown) once step K's checkpoint is saved
(one every 8 steps). Prints ``global_step N`` when training ends. The model has 4 trainable
tensors, fewer than the default 24 fragments: the synchronizer lowers the count on its own, and
the resumed run must take it again.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

torch.set_num_threads(1)

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_diloco  # noqa: E402,F401


def data() -> DataLoader:
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def trainer_run(args) -> None:  # the README's Regressor, ModelCheckpoint and fit(ckpt_path="last")
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class KillAfterCheckpoint(Callback):
        def on_train_batch_end(self, trainer, *_):  # after ModelCheckpoint's: callbacks run in order
            if trainer.global_step == args.kill_at:
                os._exit(9)

    callbacks = [ModelCheckpoint(dirpath=args.dir, save_last=True, every_n_train_steps=8), KillAfterCheckpoint()]
    trainer = pl.Trainer(strategy="decoupled_diloco", accelerator="cpu", max_steps=args.steps, logger=False,
                         callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), data(), ckpt_path="last" if args.resume else None)
    print("global_step", trainer.global_step, flush=True)


def fabric_run(args) -> None:  # docs/lightning.md's Fabric loop, counted in steps
    from lightning.fabric import Fabric

    fabric = Fabric(strategy="decoupled_diloco", accelerator="cpu", devices=1)
    fabric.launch()
    net = model()
    net, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))  # joins the run
    loader = fabric.setup_dataloaders(data())
    path = Path(args.dir) / "island.ckpt"
    state = {"model": net, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(path, state)
    while state["step"] < args.steps:
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(net(inputs), targets)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            state["step"] += 1
            if state["step"] % 8 == 0:
                fabric.save(path, state)
            if state["step"] in (args.kill_at, args.steps):
                break
        if state["step"] == args.kill_at:
            os._exit(9)
    fabric.strategy.teardown()
    print("global_step", state["step"], flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("loop", choices=["trainer", "fabric"])
    parser.add_argument("dir")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    (trainer_run if args.loop == "trainer" else fabric_run)(args)
