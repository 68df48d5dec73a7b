"""``Fabric(strategy="decoupled_diloco_fsdp")``: a Fabric process group becomes one learner island, FSDP2 inside.

The island's ranks run Lightning Fabric's :class:`~lightning.fabric.strategies.ModelParallelStrategy`
unchanged: ``fabric.setup_module(model)`` shards the model with ``parallelize_fn(model,
device_mesh)`` (by default ``fully_shard`` on the root over all of the island's ranks; pass one
that shards each layer first for a large model), and no rank ever holds the whole model. As with
the Trainer's FSDP2 island (:mod:`~lightning_diloco.learner.fsdp_strategy`, whose sharded-island
code :class:`~lightning_diloco.learner.fsdp_island.FSDPIsland` this shares) the island sees the
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

from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_diloco.learner.arguments import argument_names, describe_for_cli
from lightning_diloco.learner.fabric_island import FabricIsland
from lightning_diloco.learner.fsdp_island import FSDPIsland
from lightning_diloco.learner.island_membership import CHECKPOINT_KEY, IslandMembership

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


class DecoupledDiLoCoFabricFSDPStrategy(FabricIsland, FSDPIsland, ModelParallelStrategy):
    strategy_name = "decoupled_diloco_fsdp"
    inner_kind = "ModelParallelStrategy"

    def __init__(
        self,
        synchronizer: str | None = None,
        island: int | None = None,
        num_islands: int | None = None,
        token: str | None = None,
        *,
        parallelize_fn: Callable[[Any, Any], Any] = shard_whole_model,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **settings: Any,
    ) -> None:
        """A Lightning Fabric process group as one learner island of a Decoupled DiLoCo run, FSDP2 inside.

        Args:
            synchronizer: The synchronizer's address (``DILOCO_SYNCHRONIZER``), as for
                :class:`~lightning_diloco.learner.fabric_strategy.DecoupledDiLoCoFabricStrategy`.
            island: This island's index i in [0, num_islands) (``DILOCO_ISLAND``).
            num_islands: M, the islands in the run (``DILOCO_NUM_ISLANDS``).
            token: The run's shared secret if the synchronizer requires one (``DILOCO_TOKEN``).
            parallelize_fn: ``(module, device_mesh) -> module``, as for Fabric's
                ModelParallelStrategy: shards the module (default :func:`shard_whole_model`).
            data_parallel_size: Ranks the model is sharded over; ``"auto"``: all of the island's
                (unlike ModelParallelStrategy's default, the number of nodes).
            tensor_parallel_size: Must be 1 for now (tensor parallelism inside an island is not
                supported yet: its ranks would count the same tokens twice).
            save_distributed_checkpoint: As for ModelParallelStrategy: each rank saves its shard.
            process_group_backend: As for ModelParallelStrategy (default: gloo on CPU, nccl on GPU).
            timeout: As for ModelParallelStrategy.
            **settings: The run settings and island arguments of
                :class:`~lightning_diloco.learner.fabric_strategy.DecoupledDiLoCoFabricStrategy`
                (``sync_every``, ``num_fragments``, ``overlap_steps``, ``run_config``,
                ``push_wait``, ...).
        """
        super().__init__(
            synchronizer, island, num_islands, token, parallelize_fn=parallelize_fn,
            data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint, process_group_backend=process_group_backend,
            timeout=timeout, **settings,
        )

    @classmethod
    def inner_arguments(cls) -> set[str]:
        return argument_names(ModelParallelStrategy.__init__)

    @override
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = super().setup_module(module)
        self._set_island_module(module)  # sharded: its parameters are DTensors now
        return module

    # ---- checkpoints: the bases sharded like the weights -----------------------------------------

    def _learner_checkpoint(self, checkpoint: dict[str, Any]) -> dict:
        state = self.learner.state_dict()
        bases = state.pop("bases")
        if self._save_distributed_checkpoint:  # every rank saves its shards, beside the weights'
            checkpoint[BASES_KEY] = _as_module(self._bases_distributed(bases))
            state["bases_in"] = BASES_KEY
        else:  # rank 0 saves the whole model: the bases too, one fragment gathered at a time
            state["bases_by_name"] = self._bases_whole(bases)
        return state

    @override
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Any] | None = None) -> None:
        self._write_then_swap(path, lambda partial: super(DecoupledDiLoCoFabricFSDPStrategy, self).save_checkpoint(
            partial, state, storage_options=storage_options, filter=filter))

    def _read_bases(self, path: Any, remainder: dict[str, Any]) -> None:
        learner = (self._resume or {}).get("learner")
        if learner is not None and learner.pop("bases_in", None) == BASES_KEY:
            from torch.distributed.checkpoint import load

            targets = self._bases_to_load()
            load({BASES_KEY: targets}, checkpoint_id=Path(self.broadcast(path)))
            learner["bases_by_name"] = targets

    @override
    def teardown(self) -> None:
        try:
            super().teardown()  # the island's end, then Fabric's teardown
        except NotImplementedError as err:
            # Fabric's ModelParallelStrategy has no teardown of its own: Strategy's tears down the
            # CheckpointIO last, which ModelParallelStrategy refuses to have (Lightning 2.6). All
            # before it (the island's end, the cluster environment, precision, accelerator) is done
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


describe_for_cli(DecoupledDiLoCoFabricFSDPStrategy, {}, IslandMembership.__init__)

# registers both Fabric strategy names (this class is defined by now, which registering it needs)
from lightning_diloco.learner import fabric_strategy as _fabric_strategy  # noqa: E402,F401 - last, for its side effect
