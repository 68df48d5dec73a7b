"""``Fabric(strategy="decoupled_diloco_fsdp")``: a Fabric process group becomes one learner island, FSDP2 inside.

The island's ranks run Lightning Fabric's :class:`~lightning.fabric.strategies.ModelParallelStrategy`
unchanged: ``fabric.setup_module(model)`` shards the model with ``parallelize_fn(model,
device_mesh)`` (by default ``fully_shard`` on the root over all of the island's ranks; pass one
that shards each layer first for a large model), and no rank ever holds the whole model. The
strategy holds a :class:`~lightning_diloco.learner.fabric_island.FabricIsland` and forwards its
calls to it, as the DDP form does. As with the Trainer's FSDP2 island
(:mod:`~lightning_diloco.learner.fsdp_strategy`, whose sharded-island code,
:mod:`~lightning_diloco.learner.fsdp_island`, this shares) the island sees the
parameters as DTensors of their global shapes and names, so islands of any kind join one run.
FSDP2 replaces the parameters: create the optimizer after ``fabric.setup_module(model)`` and set
it up with ``fabric.setup_optimizers(optimizer)``, which joins the run.

Checkpoints: ``fabric.save(path, state)`` writes Fabric's own layout. In a distributed checkpoint
(``save_distributed_checkpoint=True``, the default) each rank saves its shard of the base
fragments beside its shard of the weights, as DTensors placed like the parameters (under
``"decoupled_diloco_bases"``), and the rest of the island's outer state goes into the metadata
file; in a full checkpoint the bases are gathered whole on rank 0. ``fabric.load(path, state)``
restores both; a checkpoint is written beside the old one and swapped in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_diloco.learner.arguments import FabricFSDPIslandArguments, IslandSettings, argument_names
from lightning_diloco.learner.fabric_island import FabricIsland
from lightning_diloco.learner.fsdp_island import (
    bases_to_load,
    fsdp_arguments,
    sharded_learner_state,
    write_then_swap,
)
from lightning_diloco.learner.island_membership import CHECKPOINT_KEY, island_attribute

BASES_KEY = f"{CHECKPOINT_KEY}_bases"
"""The key of the base fragments (a module of DTensor buffers, by parameter name) in a distributed checkpoint."""

__all__ = ["DecoupledDiLoCoFabricFSDPStrategy", "shard_whole_model"]


def shard_whole_model(module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    """The default ``parallelize_fn``: ``fully_shard`` on the root module, over the island's
    data-parallel ranks. A forward then gathers the whole model at once; a large model wants each
    layer sharded first (``fully_shard(layer, mesh=device_mesh["data_parallel"])`` per layer)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=device_mesh["data_parallel"])
    return module


class DecoupledDiLoCoFabricFSDPStrategy(ModelParallelStrategy):
    """A Lightning Fabric process group as one learner island of a Decoupled DiLoCo run, FSDP2 inside.

    Takes the island's arguments and run settings, as
    :class:`~lightning_diloco.learner.fabric_strategy.DecoupledDiLoCoFabricStrategy` does, and
    Fabric's ModelParallelStrategy's (``parallelize_fn`` by default :func:`shard_whole_model`;
    ``data_parallel_size="auto"``: all of the island's ranks).
    """

    strategy_name = "decoupled_diloco_fsdp"
    __getattr__ = island_attribute

    def __init__(self, **kwargs: FabricFSDPIslandArguments) -> None:
        settings, inner = IslandSettings.split(type(self).__name__, kwargs, argument_names(ModelParallelStrategy.__init__),
                                               "ModelParallelStrategy")
        super().__init__(**{"parallelize_fn": shard_whole_model, **fsdp_arguments(inner)})
        self.diloco = FabricIsland(settings, self, sharded=True)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.diloco.sampler_kwargs(super().distributed_sampler_kwargs)

    @override
    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # all of the island's ranks (ModelParallelStrategy's: the nodes)
            self._data_parallel_size = self.num_nodes * self.num_processes  # tensor_parallel_size is 1
        super().setup_environment()

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = super().setup_module(module)
        self.diloco.set_module(module)  # sharded: its parameters are DTensors now
        return module

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

    # ---- checkpoints: the bases sharded like the weights -----------------------------------------

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Any] | None = None) -> None:
        learner_state = None
        if self.diloco.learner is not None:
            learner_state, shards = sharded_learner_state(self.diloco.learner, self._save_distributed_checkpoint)
            if shards:  # every rank saves its shards, beside the weights'
                state = {**state, BASES_KEY: _as_module(shards)}
                learner_state["bases_in"] = BASES_KEY
        state = self.diloco.save(state, learner_state)
        write_then_swap(self, path, lambda partial: super(DecoupledDiLoCoFabricFSDPStrategy, self).save_checkpoint(
            partial, state, storage_options=storage_options, filter=filter))

    @override
    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if self.diloco.load(state, remainder):
            learner = (self.diloco.resume or {}).get("learner")
            if learner is not None and learner.pop("bases_in", None) == BASES_KEY:
                from torch.distributed.checkpoint import load

                if self.diloco.module is None:
                    raise RuntimeError("a sharded island's checkpoint loads its bases like the model's shards: set the "
                                       "model up (fabric.setup) before fabric.load")
                targets = bases_to_load(self.diloco.module)
                load({BASES_KEY: targets}, checkpoint_id=Path(self.broadcast(path)))
                learner["bases_by_name"] = targets
            self.diloco.rejoin()
        return remainder

    @override
    def teardown(self) -> None:
        self.diloco.teardown()
        try:
            super().teardown()
        except NotImplementedError as err:
            # Fabric's ModelParallelStrategy has no teardown of its own: Strategy's tears down the
            # CheckpointIO last, which ModelParallelStrategy refuses to have (Lightning 2.6). All
            # before it (the cluster environment, precision, accelerator) is done
            if "CheckpointIO" not in str(err):
                raise

    @override
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "decoupled_diloco_fsdp", cls, description="Decoupled DiLoCo learner island (FSDP2 inside)", override=True
        )


def _as_module(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``tensors`` as the buffers of a module, under their names (``"0.weight"``: submodule
    ``"0"``'s buffer ``weight``): Fabric saves a module's state in the distributed checkpoint,
    each rank its shards, and anything else in the rank-0 metadata file."""
    root = torch.nn.Module()
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if part not in module._modules:
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_buffer(leaf, tensor)
    return root
