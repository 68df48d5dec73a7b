"""``Trainer(strategy="decoupled_diloco_fsdp")``: a trainer group becomes one learner island, FSDP2 inside.

The island's ranks run Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
unchanged, holding a :class:`~lightning_diloco.learner.island_strategy.TrainerIsland`
(``self.diloco``) and forwarding its hooks to it: the module's ``configure_model`` shards it
(``fully_shard(layer, mesh=self.device_mesh["data_parallel"])`` per layer and on the root), and no
rank ever holds the whole model. The island sees the parameters as DTensors of their global
shapes and names, so its fragment layout is the one a DDP or one-process island of the same model
computes, and islands of any kind join one run. A fragment is gathered whole only to be sent, on
the leader, and a global fragment is written into each rank's shard
(:mod:`~lightning_diloco.learner.shards`).

Checkpoints: the island's outer state goes where Lightning puts the model. In a distributed
checkpoint (``save_distributed_checkpoint=True``, the default) each rank saves its shard of the
base fragments beside its shard of the weights, as DTensors placed like the parameters (so a
resumed island may have another number of ranks); the rest of the outer state (versions,
counters) is in the checkpoint's metadata. In a full checkpoint the bases are gathered whole on
rank 0 with the weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_diloco.learner.arguments import FSDPIslandArguments, IslandSettings, argument_names
from lightning_diloco.learner.data import rank_of, split_for
from lightning_diloco.learner.fsdp_island import (
    bases_to_load,
    fsdp_arguments,
    sharded_learner_state,
    write_then_swap,
)
from lightning_diloco.learner.island_membership import CHECKPOINT_KEY, island_attribute
from lightning_diloco.learner.island_strategy import TrainerIsland, fabric_repr

BASES = f"{CHECKPOINT_KEY}.bases."
"""Prefix of the base fragments' keys, by parameter name, in a distributed checkpoint's state_dict."""

__all__ = ["DecoupledDiLoCoFSDPStrategy"]


class DecoupledDiLoCoFSDPStrategy(ModelParallelStrategy):
    """A Lightning trainer group as one learner island of a Decoupled DiLoCo run, FSDP2 inside.

    Takes the island's arguments and run settings, as
    :class:`~lightning_diloco.learner.strategy.DecoupledDiLoCoStrategy` does, and
    ModelParallelStrategy's (``data_parallel_size="auto"``: all of the island's ranks).
    """

    strategy_name = "decoupled_diloco_fsdp"
    __getattr__ = island_attribute

    def __init__(self, **kwargs: FSDPIslandArguments) -> None:
        settings, inner = IslandSettings.split(type(self).__name__, kwargs, argument_names(ModelParallelStrategy.__init__),
                                               "ModelParallelStrategy")
        super().__init__(**fsdp_arguments(inner))
        self.diloco = TrainerIsland(settings, self, sharded=True)

    def __repr__(self) -> str:  # what Fabric shows when given this Trainer strategy
        return fabric_repr(self, "DecoupledDiLoCoFabricFSDPStrategy", " (FSDP2: pass parallelize_fn=(module, "
                           "device_mesh) -> module to shard the model as configure_model does)")

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.diloco.sampler_kwargs(super().distributed_sampler_kwargs)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return super().process_dataloader(split_for(dataloader, rank_of(self.distributed_sampler_kwargs)))

    @override
    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # all of the island's ranks (ModelParallelStrategy's: the nodes)
            self._data_parallel_size = self.num_nodes * self.num_processes  # tensor_parallel_size is 1
        super().setup_environment()

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        self.diloco.after_setup(trainer)

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

    # ---- checkpoints: the bases sharded like the weights -----------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self.diloco.learner is not None:
            state, shards = sharded_learner_state(self.diloco.learner, self._save_distributed_checkpoint)
            if shards:  # every rank saves its shards, beside the weights'
                checkpoint["state_dict"].update({BASES + name: value for name, value in shards.items()})
                state["bases_in"] = "state_dict"
            self.diloco.save(checkpoint, state)
        write_then_swap(self, filepath, lambda partial: super(DecoupledDiLoCoFSDPStrategy, self).save_checkpoint(
            checkpoint, partial, storage_options))

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self.diloco.load(checkpoint)
        learner = (self.diloco.resume or {}).get("learner")
        if learner is not None and learner.pop("bases_in", None) == "state_dict":
            from torch.distributed.checkpoint import load

            module = self.lightning_module
            assert module is not None, "the Trainer restores a checkpoint into the module it was given"
            targets = {BASES + name: value for name, value in bases_to_load(module).items()}
            load({"state_dict": targets}, checkpoint_id=Path(self.broadcast(checkpoint_path)))
            learner["bases_by_name"] = {key[len(BASES):]: value for key, value in targets.items()}
        return checkpoint

    @override
    def teardown(self) -> None:
        self.diloco.leave_run()
        super().teardown()

    @override
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "decoupled_diloco_fsdp", cls, description="Decoupled DiLoCo learner island (FSDP2 inside)", override=True
        )
