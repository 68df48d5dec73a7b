"""The one place the strategy names are registered, in Lightning's own registries.

``import lightning_diloco`` must make ``Trainer(strategy="decoupled_diloco")`` and
``Fabric(strategy="decoupled_diloco")`` work, but a synchronizer host need not have Lightning at
all, and importing it costs seconds. Lightning gives no hook for a third party's strategy names
(its registries list its own strategies as its modules load), so this works around it with an
import hook: each registry gets this package's strategies the moment its Lightning package
finishes loading (or at once, if it has), and a strategy module that is the very import that
loaded Lightning registers the moment it finishes loading itself. ``lightning.pytorch`` loads
``lightning.fabric`` first: a Trainer script registers both.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# what loads -> its registry (module, name), and the strategy classes registered in it (module, name)
STRATEGIES = {
    "lightning.pytorch": (("lightning.pytorch.strategies", "StrategyRegistry"), (
        ("lightning_diloco.learner.strategy", "DecoupledDiLoCoStrategy"),
        ("lightning_diloco.learner.fsdp_strategy", "DecoupledDiLoCoFSDPStrategy"))),
    "lightning.fabric": (("lightning.fabric.strategies", "STRATEGY_REGISTRY"), (
        ("lightning_diloco.learner.fabric_strategy", "DecoupledDiLoCoFabricStrategy"),
        ("lightning_diloco.learner.fabric_fsdp_strategy", "DecoupledDiLoCoFabricFSDPStrategy"))),
}
# modules whose classes Lightning must find loaded: LightningCLI's --trainer.callbacks+=DiLoCoMonitor
ALSO_LOADED = {"lightning.pytorch": ("lightning_diloco.learner.monitor",), "lightning.fabric": ()}


def register() -> None:
    """Register every strategy name with the registries of the Lightning packages loaded (loading
    ``lightning.pytorch``, and with it Fabric, if neither is); safe to call more than once."""
    if not any(target in sys.modules for target in STRATEGIES):
        importlib.import_module("lightning.pytorch")  # which registers, through the hook
    for target in STRATEGIES:
        if target in sys.modules:
            _register(target)


def register_when_lightning_loads() -> None:
    for target, (_, classes) in STRATEGIES.items():
        if target in sys.modules:
            _register(target)
        else:
            _Finder.watch(target)
        for module, _ in classes:
            if module not in sys.modules:
                _Finder.watch(module)


def _register(target: str, loaded: str = "") -> None:
    """Register ``target``'s strategies (``loaded``: a module whose code has just run, still
    marked as initialising)."""
    (registry_module, registry_name), classes = STRATEGIES[target]
    registry = getattr(importlib.import_module(registry_module), registry_name)
    for module_name, class_name in classes:
        module = sys.modules.get(module_name)
        if module is not None and module_name != loaded and getattr(module.__spec__, "_initializing", False):
            continue  # its import loaded Lightning: it registers when it has finished loading
        getattr(importlib.import_module(module_name), class_name).register_strategies(registry)
    for name in ALSO_LOADED[target]:
        importlib.import_module(name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the real loader of each module it watches, once, to
    register what that module's loading makes registrable."""

    watched: set[str] = set()

    @classmethod
    def watch(cls, name: str) -> None:
        if not any(isinstance(f, _Finder) for f in sys.meta_path):
            sys.meta_path.insert(0, cls())
        cls.watched.add(name)

    def find_spec(self, name, path, target=None):
        if name not in self.watched:
            return None
        self.watched.discard(name)  # one shot, and no recursion into the lookup below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module
        targets = [t for t, (_, classes) in STRATEGIES.items() if name == t or name in dict(classes)]

        def exec_then_register(module):
            run_module(module)
            for t in targets:
                if t in sys.modules:
                    _register(t, loaded=name)

        spec.loader.exec_module = exec_then_register  # this module's loader instance only
        return spec
