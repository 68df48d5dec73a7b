"""``Fabric(strategy="decoupled_diloco")``: a Fabric process group becomes one learner island, DDP inside.

The island's Fabric hooks are :class:`~lightning_diloco.learner.fabric_island.FabricIsland`'s
(joining in ``fabric.setup``, an inner step per ``optimizer.step()``, ``fabric.save`` /
``fabric.load``, ``teardown()``), shared with the FSDP2 form
(:mod:`~lightning_diloco.learner.fabric_fsdp_strategy`). A one-process island takes no process
group and no DDP wrapper, as the Trainer's strategy does.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_diloco.learner.arguments import DDP_ARGUMENTS, argument_names, describe_for_cli, given_arguments
from lightning_diloco.learner.fabric_island import FabricIsland
from lightning_diloco.learner.island_membership import IslandMembership

__all__ = ["DecoupledDiLoCoFabricStrategy", "register"]


class DecoupledDiLoCoFabricStrategy(FabricIsland, DDPStrategy):
    """A Lightning Fabric process group as one learner island of a Decoupled DiLoCo run, DDP inside.

    Takes the run settings and island arguments of
    :class:`~lightning_diloco.learner.island_membership.IslandMembership` (the Trainer
    strategy's, with the same environment variables) and DDP's arguments.
    """

    strategy_name = "decoupled_diloco"
    inner_kind = "DistributedDataParallel"

    @classmethod
    def inner_arguments(cls) -> set[str]:
        return argument_names(DDPStrategy.__init__, DistributedDataParallel.__init__) - {"module"}

    @classmethod
    def inner_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return given_arguments(kwargs, DDP_ARGUMENTS)

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
        self._set_island_module(module)
        return module if self.one_process else super().setup_module(module)

    @override
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "decoupled_diloco", cls, description="Decoupled DiLoCo learner island (DDP inside)", override=True
        )


describe_for_cli(DecoupledDiLoCoFabricStrategy, DDP_ARGUMENTS, IslandMembership.__init__)


def register() -> None:
    """Make ``Fabric(strategy="decoupled_diloco")`` (and ``"decoupled_diloco_fsdp"``) work, and
    ``Fabric(strategy=DecoupledDiLoCoStrategy(...))`` say which class to use; safe to call more than once."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    from lightning_diloco.learner.fabric_fsdp_strategy import DecoupledDiLoCoFabricFSDPStrategy

    DecoupledDiLoCoFabricStrategy.register_strategies(STRATEGY_REGISTRY)
    DecoupledDiLoCoFabricFSDPStrategy.register_strategies(STRATEGY_REGISTRY)
    _refuse_trainer_strategies()


def _refuse_trainer_strategies() -> None:
    """Fabric takes only Fabric strategies, and calls a Trainer's "an invalid strategy name". A
    Trainer island strategy given to Fabric is refused by name, with the Fabric class to write
    and the arguments it was given. Not mapped onto the Fabric class: the Trainer's objects carry
    what Fabric has no place for (the FSDP2 form shards in the module's ``configure_model``,
    Fabric's in ``parallelize_fn``), and the Fabric class takes the same arguments."""
    from lightning.fabric import connector

    check = getattr(getattr(connector, "_Connector", None), "_check_config_and_set_final_flags", None)
    if check is None or getattr(check, "_refuses_trainer_islands", False):
        return  # another Lightning than 2.6's checks elsewhere: its own message stands

    def check_config(connector, strategy, *args, **kwargs):
        from lightning_diloco.learner.island_strategy import IslandStrategy

        if isinstance(strategy, IslandStrategy):
            raise ValueError(_trainer_strategy_refusal(strategy))
        return check(connector, strategy, *args, **kwargs)

    check_config._refuses_trainer_islands = True  # type: ignore[attr-defined]
    connector._Connector._check_config_and_set_final_flags = check_config  # type: ignore[method-assign,assignment]


def _trainer_strategy_refusal(strategy: Any) -> str:
    fsdp = strategy.strategy_name == "decoupled_diloco_fsdp"
    fabric_class = "DecoupledDiLoCoFabricFSDPStrategy" if fsdp else "DecoupledDiLoCoFabricStrategy"
    given = {"synchronizer": strategy.address, **strategy.explicit}  # not the token: a secret
    if strategy.num_islands > 1:
        given.update(island=strategy.island, num_islands=strategy.num_islands)
    arguments = ", ".join(f"{k}={v!r}" for k, v in given.items() if v is not None)
    return (f"Fabric(strategy={type(strategy).__name__}(...)): that is the Lightning Trainer's strategy; Fabric takes "
            f"lightning_diloco.{fabric_class}, with the same arguments: Fabric(strategy=lightning_diloco.{fabric_class}("
            f"{arguments})), or Fabric(strategy=\"{strategy.strategy_name}\") for the defaults and the DILOCO_* environment"
            + (" (FSDP2: pass parallelize_fn=(module, device_mesh) -> module to shard the model as configure_model "
               "does)" if fsdp else ""))


register()  # importing the strategy is enough for Fabric(strategy="decoupled_diloco")
