"""``Trainer(strategy="decoupled_diloco_fsdp")``: a trainer group becomes one learner island, FSDP2 inside.

The island's ranks run Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
unchanged: the module's ``configure_model`` shards it (``fully_shard(layer,
mesh=self.device_mesh["data_parallel"])`` per layer and on the root), and no rank ever holds the
whole model. The island sees the parameters as DTensors of their global shapes and names, so its
fragment layout is the one a DDP or one-process island of the same model computes, and islands of
any kind join one run. A fragment is gathered whole only to be sent, on the leader, and a global
fragment is written into each rank's shard (:mod:`~lightning_diloco.learner.shards`).

Checkpoints: the island's outer state goes where Lightning puts the model. In a distributed
checkpoint (``save_distributed_checkpoint=True``, the default) each rank saves its shard of the
base fragments beside its shard of the weights, as DTensors placed like the parameters (so a
resumed island may have another number of ranks); the rest of the outer state (versions,
counters) is in the checkpoint's metadata. In a full checkpoint the bases are gathered whole on
rank 0 with the weights.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_diloco.learner.arguments import argument_names, describe_for_cli
from lightning_diloco.learner.fsdp_island import FSDPIsland
from lightning_diloco.learner.island_membership import CHECKPOINT_KEY, IslandMembership
from lightning_diloco.learner.island_strategy import IslandStrategy

BASES = f"{CHECKPOINT_KEY}.bases."
"""Prefix of the base fragments' keys, by parameter name, in a distributed checkpoint's state_dict."""

__all__ = ["DecoupledDiLoCoFSDPStrategy"]


class DecoupledDiLoCoFSDPStrategy(IslandStrategy, FSDPIsland, ModelParallelStrategy):
    strategy_name = "decoupled_diloco_fsdp"
    inner_kind = "ModelParallelStrategy"

    def __init__(
        self,
        synchronizer: str | None = None,
        island: int | None = None,
        num_islands: int | None = None,
        token: str | None = None,
        *,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **settings: Any,
    ) -> None:
        """A Lightning trainer group as one learner island of a Decoupled DiLoCo run, FSDP2 inside.

        Args:
            synchronizer: The synchronizer's address (``DILOCO_SYNCHRONIZER``), as for
                :class:`~lightning_diloco.learner.strategy.DecoupledDiLoCoStrategy`.
            island: This island's index i in [0, num_islands) (``DILOCO_ISLAND``).
            num_islands: M, the islands in the run (``DILOCO_NUM_ISLANDS``).
            token: The run's shared secret if the synchronizer requires one (``DILOCO_TOKEN``).
            data_parallel_size: Ranks the model is sharded over; ``"auto"``: all of the island's
                (unlike ModelParallelStrategy's default, the number of nodes).
            tensor_parallel_size: Must be 1 for now (tensor parallelism inside an island is not
                supported yet: its ranks would count the same tokens twice).
            save_distributed_checkpoint: As for ModelParallelStrategy: each rank saves its shard.
            process_group_backend: As for ModelParallelStrategy (default: gloo on CPU, nccl on GPU).
            timeout: As for ModelParallelStrategy.
            **settings: The run settings and island arguments of
                :class:`~lightning_diloco.learner.strategy.DecoupledDiLoCoStrategy`
                (``sync_every``, ``num_fragments``, ``overlap_steps``, ``run_config``,
                ``push_wait``, ...).
        """
        super().__init__(
            synchronizer, island, num_islands, token, data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size, save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend, timeout=timeout, **settings,
        )

    @classmethod
    def inner_arguments(cls) -> set[str]:
        return argument_names(ModelParallelStrategy.__init__)

    # ---- checkpoints: the bases sharded like the weights -----------------------------------------

    def _learner_checkpoint(self, checkpoint: dict[str, Any]) -> dict:
        state = self.learner.state_dict()
        bases = state.pop("bases")
        if self._save_distributed_checkpoint:  # every rank saves its shards, beside the weights'
            for name, value in self._bases_distributed(bases).items():
                checkpoint["state_dict"][BASES + name] = value
            state["bases_in"] = "state_dict"
        else:  # rank 0 saves the whole model: the bases too, one fragment gathered at a time
            state["bases_by_name"] = self._bases_whole(bases)
        return state

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        self._write_then_swap(filepath, lambda partial: super(DecoupledDiLoCoFSDPStrategy, self).save_checkpoint(
            checkpoint, partial, storage_options))

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        learner = (self._resume or {}).get("learner")
        if learner is not None and learner.pop("bases_in", None) == "state_dict":
            from torch.distributed.checkpoint import load

            targets = {BASES + name: value for name, value in self._bases_to_load().items()}
            load({"state_dict": targets}, checkpoint_id=Path(self.broadcast(checkpoint_path)))
            learner["bases_by_name"] = {key[len(BASES):]: value for key, value in targets.items()}
        return checkpoint

    @override
    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(
            "decoupled_diloco_fsdp", cls, description="Decoupled DiLoCo learner island (FSDP2 inside)", override=True
        )


describe_for_cli(DecoupledDiLoCoFSDPStrategy, {}, IslandMembership.__init__)

# registers both strategy names (this class is defined by now, which registering it needs)
from lightning_diloco.learner import strategy as _strategy  # noqa: E402,F401 - last, for its side effect
