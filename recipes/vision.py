"""Vision recipe: image classification with a transformers ViT (or a small CNN) on Fashion-MNIST
from Debian's ``dataset-fashion-mnist``, Decoupled DiLoCo against DDP.

    python -m recipes.vision --islands 4                       # ViT, Decoupled DiLoCo, 4 islands
    python -m recipes.vision --islands 4 --strategy ddp        # DDP over 4 processes
    python -m recipes.vision --preset cpu-tiny-cnn --islands 4
    python -m recipes.vision --dataset zalando-datasets/fashion_mnist   # a Hub dataset instead

The ViT is built from a config (random init, nothing downloaded); images are grey, 28 x 28.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_diloco.core.presets import large_model, small_model  # noqa: E402
from recipes.common import DDP, Preset, Recipe, Reference, cosine_with_warmup  # noqa: E402
from recipes.common import main as run_recipe

TINY_VIT = dict(arch="vit", hidden=64, layers=2, heads=4, intermediate=128, patch=7, image=28)
PRESETS = {
    # the text sweep's best setting (docs/recipes.md#choosing-the-settings-the-sweep-text-dense-cpu-tiny); the ViT has 40 tensors
    "cpu-tiny": Preset(model=TINY_VIT, batch=32, steps=600, lr=2e-3, run_config=small_model(8), references=(Reference(DDP, 4, 0.8312, 0.0065),)),
    "cpu-tiny-cnn": Preset(model={**TINY_VIT, "arch": "cnn", "hidden": 32}, batch=32, steps=600, lr=2e-3,
                           run_config=small_model(4)),  # 8 tensors
    # GPU sizes, same code: ViT-S/4 (about 21M parameters) and ViT-B/4 (about 86M) on 28 x 28 images.
    "gpu-vit-small": Preset(model=dict(arch="vit", hidden=384, layers=12, heads=6, intermediate=1536, patch=4, image=28),
                            batch=256, steps=20_000, lr=1e-3, run_config=large_model(sync_every=100, num_fragments=12)),
    "gpu-vit-base": Preset(model=dict(arch="vit", hidden=768, layers=12, heads=12, intermediate=3072, patch=4, image=28),
                           batch=256, steps=20_000, lr=5e-4, run_config=large_model(sync_every=100, num_fragments=12)),
}
CLASSES = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and data (default: the preset's)")
    g.add_argument("--arch", choices=["vit", "cnn"])
    for name in ("hidden", "layers", "heads", "intermediate", "patch", "image"):
        g.add_argument("--" + name, type=int)
    g.add_argument("--dataset", help="a Hub image-classification dataset instead of Debian's Fashion-MNIST")


def build_network(a: argparse.Namespace):
    import torch
    from torch import nn

    torch.manual_seed(a.seed)  # every island and rank starts from the same weights
    if a.arch == "cnn":
        w = a.hidden
        return nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(2 * w * (a.image // 4) ** 2, 128), nn.ReLU(), nn.Linear(128, CLASSES),
        )
    from transformers import ViTConfig, ViTForImageClassification

    vit = ViTForImageClassification(ViTConfig(
        image_size=a.image, patch_size=a.patch, num_channels=1, hidden_size=a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, intermediate_size=a.intermediate, num_labels=CLASSES,
    ))
    return _Logits(vit)


def _Logits(vit):
    from torch import nn

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit = vit

        def forward(self, x):
            return self.vit(pixel_values=x).logits

    return Logits()


def build_module(a: argparse.Namespace):
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torchmetrics import MeanMetric
    from torchmetrics.classification import MulticlassAccuracy

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build_network(a)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def eval_metrics(self):  # rank 0 evaluates alone: no cross-rank sync in compute()
            return {"eval_loss": MeanMetric(sync_on_compute=False).to(self.device),
                    "accuracy": MulticlassAccuracy(num_classes=CLASSES, average="micro", sync_on_compute=False).to(self.device)}

        def eval_update(self, metrics, batch) -> None:
            x, y = batch
            logits = self.net(x)
            metrics["eval_loss"].update(F.cross_entropy(logits, y), weight=len(y))
            metrics["accuracy"].update(logits, y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=a.lr, weight_decay=0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(a.steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Classifier()


def datasets(a: argparse.Namespace):
    from recipes.data import fashion_mnist, hub_images

    if a.dataset:
        return hub_images(a.dataset, "train", a.image), hub_images(a.dataset, "test", a.image)
    return fashion_mnist("train"), fashion_mnist("test")


RECIPE = Recipe(name="vision", module="recipes.vision", presets=PRESETS, metric="accuracy",
                add_arguments=add_arguments, build_module=build_module, datasets=datasets,
                tokens_per_sample=lambda a: 1)  # "tokens" are images here


def main(argv: list[str] | None = None) -> int:
    return run_recipe(RECIPE, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
