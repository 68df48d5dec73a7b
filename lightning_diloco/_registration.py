"""Register ``strategy="decoupled_diloco"`` with Lightning without importing Lightning ourselves.

``import lightning_diloco`` must make ``Trainer(strategy="decoupled_diloco")`` and
``Fabric(strategy="decoupled_diloco")`` work, but a synchronizer host need not have Lightning at
all, and importing it costs seconds. So the Trainer's strategies are registered the moment
``lightning.pytorch`` finishes loading, and Fabric's the moment ``lightning.fabric`` does (or at
once, for either that has already loaded). ``lightning.pytorch`` loads ``lightning.fabric``
first: a Trainer script registers both.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# what loads -> the strategy modules that register themselves when they finish loading (the first
# is imported), then any other module whose classes Lightning must find loaded
STRATEGY_MODULES = {
    "lightning.pytorch": ("lightning_diloco.learner.strategy", "lightning_diloco.learner.fsdp_strategy"),
    "lightning.fabric": ("lightning_diloco.learner.fabric_strategy", "lightning_diloco.learner.fabric_fsdp_strategy"),
}
ALSO_LOADED = {
    # a loaded Callback subclass: LightningCLI's --trainer.callbacks+=DiLoCoMonitor finds it by name
    "lightning.pytorch": ("lightning_diloco.learner.monitor",),
    "lightning.fabric": (),
}


def register_when_lightning_loads() -> None:
    for target in STRATEGY_MODULES:
        if target in sys.modules:
            _register(target)
        elif not any(isinstance(f, _Finder) and f.target == target for f in sys.meta_path):
            sys.meta_path.insert(0, _Finder(target))


def _register(target: str) -> None:
    # The strategy modules register their strategies when they finish loading. If one is in
    # sys.modules it has done so, or it is the very import that loaded Lightning (``from
    # lightning_diloco import DecoupledDiLoCoStrategy`` first) and will do so on its last line:
    # importing it from here would only meet a half-initialised module.
    modules = STRATEGY_MODULES[target]
    if not any(name in sys.modules for name in modules):
        importlib.import_module(modules[0])
    for name in ALSO_LOADED[target]:
        importlib.import_module(name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real loader of ``target`` once."""

    def __init__(self, target: str) -> None:
        self.target = target

    def find_spec(self, name, path, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # one shot, and no recursion into the lookup below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_then_register(module):
            run_module(module)
            _register(self.target)

        spec.loader.exec_module = exec_then_register  # this module's loader instance only
        return spec
