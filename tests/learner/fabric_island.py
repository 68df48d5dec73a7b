"""One Fabric learner island, as a user writes its loop: :func:`train` in-process, or a process
``python fabric_island.py OUT [--devices N] [--fsdp] [--overlap TAU] [--epochs E] [--save CKPT]
[--resume CKPT]`` that reads DILOCO_* from the environment and writes each rank's final (whole)
weights, losses and the island's metrics to OUT/rank{R}.pt; with --save, each rank's local base
fragments as saved to OUT/rank{R}-bases-saved.pt, with --resume as loaded to
OUT/rank{R}-bases-loaded.pt."""

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
          wait_for_islands: int = 0, step_seconds: float = 0.0, on_save=None, on_resume=None,
          ) -> tuple[nn.Module, list[float]]:
    """Fabric's loop: set up, (resume,) train ``epochs`` epochs saving after each, return the
    model and its losses. ``wait_for_islands``: start only once that many islands have joined.
    An FSDP2 island (whose sharding replaces the parameters) sets the model up before creating
    its optimizer. ``on_save``/``on_resume``: called after each save / the resume."""
    model = tiny_regressor(seed)
    if getattr(fabric.strategy, "strategy_name", "") == "decoupled_diloco_fsdp":
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(regression_data(n), batch_size=16))
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if resume is not None:
        fabric.load(resume, state)
        if on_resume is not None:
            on_resume()
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
            if on_save is not None:
                on_save()
    return model, losses


def _whole(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()


def main() -> None:
    from lightning.fabric import Fabric

    from lightning_diloco import DecoupledDiLoCoFabricFSDPStrategy, DecoupledDiLoCoFabricStrategy
    from lightning_diloco.learner.collective import leave_process_group
    from tests.helpers import exit_now

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--overlap", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--no-wait", action="store_true", help="start without waiting for the other islands")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kind = DecoupledDiLoCoFabricFSDPStrategy if args.fsdp else DecoupledDiLoCoFabricStrategy
    strategy = kind(sync_every=4, num_fragments=2, overlap_steps=args.overlap, uplink_codec="fp32",
                    downlink_codec="fp32")  # a remote synchronizer's own settings win
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=args.devices)
    fabric.launch()

    def bases(name):
        return lambda: torch.save(strategy.learner.state_dict()["bases"], out / f"rank{fabric.global_rank}-bases-{name}.pt")

    model, losses = train(fabric, args.epochs, seed=strategy.island, n=512, step_seconds=0.02, save=args.save,
                          resume=args.resume, on_save=bases("saved"), on_resume=bases("loaded"),
                          wait_for_islands=0 if args.no_wait else strategy.num_islands)
    strategy.teardown()  # ends on the global model
    torch.save({"weights": [_whole(p) for p in model.parameters()], "metrics": strategy.metrics(),
                "losses": losses}, out / f"rank{fabric.global_rank}.pt")
    leave_process_group()
    exit_now()


if __name__ == "__main__":
    main()
