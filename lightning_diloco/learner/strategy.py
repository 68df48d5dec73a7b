"""``Trainer(strategy="decoupled_diloco")``: a trainer group becomes one learner island, DDP inside.

Inside a multi-process island everything is ordinary DDP (one process per device). A one-process
island takes Lightning's single-device path instead: no process group and no DDP wrapper, which in
one process would only copy gradients every step. Everything island-facing is
:class:`~lightning_diloco.learner.island_strategy.IslandStrategy`'s, shared with the FSDP2 island
(:mod:`~lightning_diloco.learner.fsdp_strategy`).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, Strategy, StrategyRegistry
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_diloco.learner.arguments import DDP_ARGUMENTS, argument_names, describe_for_cli, given_arguments
from lightning_diloco.learner.island_membership import IslandMembership, RefusedByRun
from lightning_diloco.learner.island_strategy import IslandStrategy

__all__ = ["DecoupledDiLoCoStrategy", "RefusedByRun", "register"]


class DecoupledDiLoCoStrategy(IslandStrategy, DDPStrategy):
    """A Lightning trainer group as one learner island of a Decoupled DiLoCo run, DDP inside.

    Takes the run settings (see :class:`~lightning_diloco.learner.island_membership.IslandMembership`) and
    DDP's arguments.
    """

    strategy_name = "decoupled_diloco"
    inner_kind = "DistributedDataParallel"

    @classmethod
    def inner_arguments(cls) -> set[str]:
        return argument_names(DDPStrategy.__init__, DistributedDataParallel.__init__) - {"module"}

    @classmethod
    def inner_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return given_arguments(kwargs, DDP_ARGUMENTS)

    # ---- a one-process island: Lightning's single-device path ----------------------------------

    @property
    def one_process(self) -> bool:
        return self.num_nodes * self.num_processes == 1

    @override
    def _configure_launcher(self) -> None:
        if not self.one_process:
            return super()._configure_launcher()
        # no launcher, as on the single-device path: DDP's would also reset torch's thread count to
        # cores / processes, overriding the script's own torch.set_num_threads
        self._launcher = None

    @override
    def setup_distributed(self) -> None:
        if not self.one_process:
            return super().setup_distributed()
        reset_seed()  # as DDPStrategy does, so a seeded run draws the same numbers either way
        self.set_world_ranks()

    @override
    def _setup_model(self, model):
        return model if self.one_process else super()._setup_model(model)

    @override
    def setup(self, trainer) -> None:
        if not self.one_process:
            return super().setup(trainer)
        # DDPStrategy.setup wraps the model in DDP, or (when not fitting) broadcasts its states
        # over the process group; the base strategy's setup is the single-device sequence
        Strategy.setup(self, trainer)
        self._join_after_setup(trainer)

    @override
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "decoupled_diloco", cls, description="Decoupled DiLoCo learner island (DDP inside)", override=True
        )
        strategy_registry.register(
            "decoupled_diloco_spawn", cls, description="Decoupled DiLoCo learner island, spawned DDP",
            start_method="spawn", override=True,
        )


describe_for_cli(DecoupledDiLoCoStrategy, DDP_ARGUMENTS, IslandMembership.__init__)


def register() -> None:
    """Make ``Trainer(strategy="decoupled_diloco")`` (and ``"decoupled_diloco_fsdp"``) work; safe
    to call more than once."""
    from lightning_diloco.learner.fsdp_strategy import DecoupledDiLoCoFSDPStrategy

    DecoupledDiLoCoStrategy.register_strategies(StrategyRegistry)
    DecoupledDiLoCoFSDPStrategy.register_strategies(StrategyRegistry)


register()  # importing the strategy is enough for Trainer(strategy="decoupled_diloco")
