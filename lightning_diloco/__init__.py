"""lightning_diloco: Decoupled DiLoCo for PyTorch Lightning.

Importing the package registers ``Trainer(strategy="decoupled_diloco")`` (and
``"decoupled_diloco_spawn"``, ``"decoupled_diloco_fsdp"``) and ``Fabric(strategy="decoupled_diloco")``
(and ``"decoupled_diloco_fsdp"``) with Lightning's registries, once Lightning is loaded
(``_registration.py``): the synchronizer and the core never import Lightning themselves.
"""

from __future__ import annotations

import importlib

from lightning_diloco._registration import register_when_lightning_loads

__version__ = "0.1.0"

_LAZY = {
    "DecoupledDiLoCoStrategy": "lightning_diloco.learner.strategy",
    "DecoupledDiLoCoFSDPStrategy": "lightning_diloco.learner.fsdp_strategy",
    "DecoupledDiLoCoFabricStrategy": "lightning_diloco.learner.fabric_strategy",
    "DecoupledDiLoCoFabricFSDPStrategy": "lightning_diloco.learner.fabric_fsdp_strategy",
    "register": "lightning_diloco._registration",
    "DiLoCoMonitor": "lightning_diloco.learner.monitor",
    "ProgressFile": "lightning_diloco.launch.progress",
    "data_rank": "lightning_diloco.learner.data",
    "DataRank": "lightning_diloco.learner.data",
    "load_global_model": "lightning_diloco.learner.export",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_diloco' has no attribute {name!r}")


register_when_lightning_loads()
