"""``Fabric(strategy="decoupled_diloco")``: a Fabric process group becomes one learner island, DDP inside.

Lightning Fabric's :class:`~lightning.fabric.strategies.DDPStrategy`, holding a
:class:`~lightning_diloco.learner.fabric_island.FabricIsland` (``self.diloco``: joining in
``fabric.setup``, an inner step per ``optimizer.step()``, ``fabric.save`` / ``fabric.load``,
``teardown()``) and forwarding its calls to it. A one-process island takes no process group and
no DDP wrapper, as the Trainer's strategy does.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_diloco.learner.arguments import DDP_ARGUMENTS, DDPIslandArguments, IslandSettings, argument_names
from lightning_diloco.learner.fabric_island import FabricIsland
from lightning_diloco.learner.island_membership import island_attribute

__all__ = ["DecoupledDiLoCoFabricStrategy"]


class DecoupledDiLoCoFabricStrategy(DDPStrategy):
    """A Lightning Fabric process group as one learner island of a Decoupled DiLoCo run, DDP inside.

    Takes the arguments of :class:`~lightning_diloco.learner.strategy.DecoupledDiLoCoStrategy`
    (the Trainer's, with the same environment variables). ``strategy.island``, ``.run_config``,
    ``.learner``, ``.metrics()``, ... are its island's (``strategy.diloco``).
    """

    strategy_name = "decoupled_diloco"
    __getattr__ = island_attribute

    def __init__(self, **kwargs: DDPIslandArguments) -> None:
        inner = argument_names(DDPStrategy.__init__, DistributedDataParallel.__init__) - {"module"}
        settings, ddp = IslandSettings.split(type(self).__name__, kwargs, inner | set(DDP_ARGUMENTS),
                                             "DistributedDataParallel")
        super().__init__(**ddp)
        self.diloco = FabricIsland(settings, self)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.diloco.sampler_kwargs(super().distributed_sampler_kwargs)

    # ---- a one-process island: no process group, no DDP wrapper ---------------------------------

    @property
    def one_process(self) -> bool:
        return self.num_nodes * self.num_processes == 1

    @override
    def _configure_launcher(self) -> None:
        if not self.one_process:
            return super()._configure_launcher()
        self._launcher = None  # nothing to launch; fabric.launch() runs the function here

    @override
    def setup_environment(self) -> None:
        if not self.one_process:
            return super().setup_environment()
        Strategy.setup_environment(self)  # the device only, as Fabric's single-device strategy
        self._backward_sync_control = None  # no DDP wrapper: fabric.no_backward_sync has nothing to skip

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:  # type: ignore[override]  # one process: unwrapped
        self.diloco.set_module(module)
        return module if self.one_process else super().setup_module(module)

    # ---- the island's calls ------------------------------------------------------------------------

    @override
    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = super().setup_optimizer(optimizer)
        self.diloco.after_setup_optimizer(optimizer)
        return optimizer

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, **kwargs)
        self.diloco.after_optimizer_step(optimizer)
        return output

    @override
    def process_dataloader(self, dataloader: DataLoader) -> DataLoader:
        return self.diloco.counting(super().process_dataloader(self.diloco.split(dataloader)))

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Any] | None = None) -> None:
        super().save_checkpoint(path, self.diloco.save(state), storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if self.diloco.load(state, remainder):
            self.diloco.rejoin()
        return remainder

    @override
    def teardown(self) -> None:
        self.diloco.teardown()
        super().teardown()

    @override
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "decoupled_diloco", cls, description="Decoupled DiLoCo learner island (DDP inside)", override=True
        )
