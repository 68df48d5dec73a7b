"""Register ``strategy="decoupled_diloco"`` with Lightning without importing Lightning ourselves.

``import lightning_diloco`` must make ``Trainer(strategy="decoupled_diloco")`` work, but a
synchronizer host need not have Lightning at all, and importing it costs seconds. So the strategy
is registered the moment ``lightning.pytorch`` finishes loading (or at once if it already has).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

TARGET = "lightning.pytorch"
STRATEGY_MODULES = ("lightning_diloco.learner.strategy", "lightning_diloco.learner.fsdp_strategy")


def register_when_lightning_loads() -> None:
    if TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _register() -> None:
    # The strategy modules register both strategies when they finish loading. If one is in
    # sys.modules it has done so, or it is the very import that loaded Lightning (``from
    # lightning_diloco import DecoupledDiLoCoStrategy`` first) and will do so on its last line:
    # importing it from here would only meet a half-initialised module.
    if not any(name in sys.modules for name in STRATEGY_MODULES):
        importlib.import_module(STRATEGY_MODULES[0])
    # a loaded Callback subclass: LightningCLI's --trainer.callbacks+=DiLoCoMonitor finds it by name
    importlib.import_module("lightning_diloco.learner.monitor")


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real loader of ``lightning.pytorch`` once."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # one shot, and no recursion into the lookup below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_then_register(module):
            run_module(module)
            _register()

        spec.loader.exec_module = exec_then_register  # this module's loader instance only
        return spec
