"""What makes an FSDP2 island, whether a Trainer's or Fabric's: sharded parameters and sharded bases.

:class:`FSDPIsland` is mixed in before Lightning's ``ModelParallelStrategy`` (the Trainer's,
:mod:`~lightning_diloco.learner.fsdp_strategy`, or Fabric's,
:mod:`~lightning_diloco.learner.fabric_fsdp_strategy`): the island's ranks hold shards
(DTensors) of every parameter, and :mod:`~lightning_diloco.learner.shards` moves fragments
between shards and whole fragments. What both forms share is here: the mesh over all of the
island's ranks, the reshard before the island writes, and the base fragments in a checkpoint,
either as DTensors placed like the parameters (a distributed checkpoint: each rank saves its
shards, and a resumed island may have another number of ranks) or gathered whole on rank 0 (a
full checkpoint). Where in the checkpoint they go is the framework's.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_diloco.core.fragments import split_fragment, tensor_specs, trainable_parameters
from lightning_diloco.learner.island_membership import IslandMembership


class FSDPIsland(IslandMembership):
    """The FSDP2 half of an island strategy; the other half is a ``ModelParallelStrategy``."""

    _data_parallel_size: Any  # ModelParallelStrategy's
    _tensor_parallel_size: Any
    num_nodes: int
    num_processes: int

    def __init__(self, *args: Any, tensor_parallel_size: int = 1, **kwargs: Any) -> None:
        if tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size}: tensor parallelism inside an island is not supported yet; "
                "use tensor_parallel_size=1 (FSDP2 over all of the island's devices)"
            )
        super().__init__(*args, tensor_parallel_size=tensor_parallel_size, **kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # before the mesh is built from it: all of the island's ranks
            self._data_parallel_size = self.num_nodes * self.num_processes // self._tensor_parallel_size
        super().setup_environment()  # type: ignore[misc]  # ModelParallelStrategy's

    def _join(self) -> None:
        # a forward without backward (the Trainer's sanity check) may have left the root's
        # parameters gathered (and registered in place of the DTensors): the island must see the
        # shards, and its first writes must reach them
        self._reshard()
        super()._join()
        self.learner.shards.before_write = self._reshard

    def _reshard(self) -> None:
        """FSDP2 keeps the root module's gathered parameters after a forward without backward (an
        evaluation); a write into the shards would not reach them. Resharding drops them."""
        from torch.distributed.fsdp import FSDPModule

        for module in self._island_module().modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # ---- the base fragments in a checkpoint --------------------------------------------------

    def _bases_distributed(self, bases: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shards of the base fragments (``bases``, the learner's) by parameter name,
        as DTensors placed like the parameters, for a distributed checkpoint."""
        shards, layout = self.learner.shards, self.learner.layout
        out = {}
        for p, flat in enumerate(bases):
            for i, local in zip(layout.fragments[p], shards.local_pieces(p, flat)):
                out[layout.specs[i].name] = shards.as_distributed(i, local.clone())
        return out

    def _bases_whole(self, bases: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The base fragments whole by parameter name on rank 0 (empty elsewhere), gathered one
        fragment at a time, for a full checkpoint. Every rank must call it."""
        shards, layout = self.learner.shards, self.learner.layout
        whole: dict[str, torch.Tensor] = {}
        for p, flat in enumerate(bases):
            fragment = shards.gather(p, flat)
            if fragment is not None:
                specs = layout.fragment_specs(p)
                whole.update(zip((s.name for s in specs), (t.clone() for t in split_fragment(fragment, specs))))
        return whole

    def _bases_to_load(self) -> dict[str, torch.Tensor]:
        """Where a distributed checkpoint's base fragments load into, by parameter name: DTensors
        placed like the parameters, in the global model's dtype (fp32) whatever the parameters' own."""
        params = trainable_parameters(self._island_module())
        return {s.name: torch.zeros_like(params[s.name].detach(), dtype=torch.float32)
                for s in tensor_specs(self._island_module())}

    def _write_then_swap(self, path: Any, write: Callable[[Path], None]) -> None:
        """``write(partial)`` writes the checkpoint beside the old one, then it is swapped in: a
        distributed checkpoint is a folder its ranks fill file by file, and an island killed while
        saving (a fault, or its launcher's chaos) must still find the previous one whole when it
        restarts."""
        path = Path(self.broadcast(path))  # type: ignore[attr-defined]  # the Lightning strategy's
        partial, old = path.with_name(path.name + ".partial"), path.with_name(path.name + ".old")
        if self.global_rank == 0:
            _remove(partial)
        self.barrier()  # type: ignore[attr-defined]
        write(partial)
        self.barrier()  # type: ignore[attr-defined]
        if self.global_rank == 0:
            _remove(old)
            if path.exists():
                path.rename(old)
            partial.rename(path)  # between the two renames (microseconds) there is no checkpoint
            _remove(old)
        self.barrier()  # type: ignore[attr-defined]

    def _learner_resume(self) -> dict | None:
        resume = super()._learner_resume()
        if resume is None or "bases_by_name" not in resume:
            return resume
        by_name, shards, layout = resume.pop("bases_by_name"), self.learner.shards, self.learner.layout
        missing = sorted({s.name for s in layout.specs} - set(by_name))
        if missing:
            raise ValueError(f"the checkpoint holds no base fragments for {missing[:3]}: resume with the same model")
        resume["bases"] = []
        for p in range(layout.num_fragments):
            parts = []
            for i in layout.fragments[p]:
                value = by_name[layout.specs[i].name]  # a DTensor loaded sharded, or a whole tensor
                local = value.to_local() if hasattr(value, "to_local") else shards.local_part(i, value)
                parts.append(local.reshape(-1).to("cpu", torch.float32))
            resume["bases"].append(torch.cat(parts))
        return resume


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
