"""One Fabric learner island, as a user writes its loop: :func:`train` in-process, or a process
``python fabric_island.py OUT [--devices N]`` that reads DILOCO_* from the environment and writes
each rank's final weights and the island's metrics to OUT/rank{R}.pt."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


def regression_data(n: int = 256, dim: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = x @ torch.randn(dim, 1, generator=g) + 0.01 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def tiny_regressor(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def train(fabric, epochs: int, *, seed: int = 0, n: int = 256, save: Path | None = None, resume: Path | None = None,
          wait_for_islands: int = 0, step_seconds: float = 0.0) -> tuple[nn.Module, list[float]]:
    """Fabric's loop: set up, (resume,) train ``epochs`` epochs saving after each, return the
    model and its losses. ``wait_for_islands``: start only once that many islands have joined."""
    model = tiny_regressor(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(regression_data(n), batch_size=16))
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if resume is not None:
        fabric.load(resume, state)
    link = fabric.strategy.learner.link
    deadline = time.monotonic() + 120
    while wait_for_islands and link is not None and len(link.status().live_islands) < wait_for_islands:
        assert time.monotonic() < deadline, "the other islands never joined"
        time.sleep(0.1)
    losses = []
    for epoch in range(state["epoch"], epochs):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            losses.append(float(loss.detach()))
            time.sleep(step_seconds)
        state["epoch"] = epoch + 1
        if save is not None:
            fabric.save(save, state)
    return model, losses


def main() -> None:
    from lightning.fabric import Fabric

    from lightning_diloco import DecoupledDiLoCoFabricStrategy
    from lightning_diloco.learner.collective import leave_process_group
    from tests.helpers import exit_now

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    strategy = DecoupledDiLoCoFabricStrategy(sync_every=4, num_fragments=2, overlap_steps=1, uplink_codec="fp32",
                                             downlink_codec="fp32")  # a remote synchronizer's own settings win
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=args.devices)
    fabric.launch()
    model, losses = train(fabric, 2, seed=strategy.island, n=512, wait_for_islands=strategy.num_islands,
                          step_seconds=0.02)
    strategy.teardown()  # ends on the global model
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save({"weights": [p.detach() for p in model.parameters()], "metrics": strategy.metrics(),
                "losses": losses}, Path(args.out) / f"rank{fabric.global_rank}.pt")
    leave_process_group()
    exit_now()


if __name__ == "__main__":
    main()
