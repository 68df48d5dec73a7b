"""``Trainer(strategy="decoupled_diloco")``: a trainer group becomes one learner island, DDP inside.

Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`, holding a
:class:`~lightning_diloco.learner.island_strategy.TrainerIsland` (``self.diloco``) and forwarding
its hooks to it. Inside a multi-process island everything is ordinary DDP (one process per
device). A one-process island takes Lightning's single-device path instead: no process group and
no DDP wrapper, which in one process would only copy gradients every step.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_diloco.learner.arguments import DDP_ARGUMENTS, DDPIslandArguments, IslandSettings, argument_names
from lightning_diloco.learner.data import rank_of, split_for
from lightning_diloco.learner.island_membership import RefusedByRun, island_attribute
from lightning_diloco.learner.island_strategy import TrainerIsland, fabric_repr

__all__ = ["DecoupledDiLoCoStrategy", "RefusedByRun"]


class DecoupledDiLoCoStrategy(DDPStrategy):
    """A Lightning trainer group as one learner island of a Decoupled DiLoCo run, DDP inside.

    Takes the island's arguments and run settings
    (:class:`~lightning_diloco.learner.arguments.IslandSettings`, every run setting by name) and
    DDP's (e.g. ``find_unused_parameters=True``). ``strategy.island``, ``.run_config``,
    ``.learner``, ``.metrics()``, ... are its island's (``strategy.diloco``).
    """

    strategy_name = "decoupled_diloco"
    __getattr__ = island_attribute

    def __init__(self, **kwargs: DDPIslandArguments) -> None:
        inner = argument_names(DDPStrategy.__init__, DistributedDataParallel.__init__) - {"module"}
        settings, ddp = IslandSettings.split(type(self).__name__, kwargs, inner | set(DDP_ARGUMENTS),
                                             "DistributedDataParallel")
        super().__init__(**ddp)
        self.diloco = TrainerIsland(settings, self)

    def __repr__(self) -> str:  # what Fabric shows when given this Trainer strategy
        return fabric_repr(self, "DecoupledDiLoCoFabricStrategy")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.diloco.sampler_kwargs(super().distributed_sampler_kwargs)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # where Lightning lets a strategy change each loader, after its sampler is injected: an
        # iterable dataset got none, and a Hugging Face one is split here for the same data rank
        return super().process_dataloader(split_for(dataloader, rank_of(self.distributed_sampler_kwargs)))

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
        # DDPStrategy.setup wraps the model in DDP, or (when not fitting) broadcasts its states
        # over the process group; the base strategy's setup is the single-device sequence
        (Strategy.setup(self, trainer) if self.one_process else super().setup(trainer))
        self.diloco.after_setup(trainer)

    # ---- the island's hooks --------------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        self.diloco.on_train_start()
        super().on_train_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any):
        self.diloco.count(args[0] if args else kwargs.get("batch"))
        return super().training_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.diloco.after_optimizer_step(optimizer)
        return output

    @override
    def on_train_end(self) -> None:
        self.diloco.finish()
        super().on_train_end()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        self.diloco.save(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.diloco.load(checkpoint)
        return checkpoint

    @override
    def teardown(self) -> None:
        self.diloco.leave_run()
        super().teardown()

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

