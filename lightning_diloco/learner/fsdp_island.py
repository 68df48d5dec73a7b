"""What the two FSDP2 strategies (the Trainer's, :mod:`~lightning_diloco.learner.fsdp_strategy`,
and Fabric's, :mod:`~lightning_diloco.learner.fabric_fsdp_strategy`) share: sharded parameters
and sharded bases.

The island's ranks hold shards (DTensors) of every parameter, and
:mod:`~lightning_diloco.learner.shards` moves fragments between shards and whole fragments. Here:
the arguments (no tensor parallelism), the reshard before the island writes, and the base
fragments in a checkpoint, either as DTensors placed like the parameters (a distributed
checkpoint: each rank saves its shards, and a resumed island may have another number of ranks)
or gathered whole on rank 0 (a full checkpoint). Where in the checkpoint they go is the
framework's.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_diloco.core.fragments import split_fragment, tensor_specs, trainable_parameters


def fsdp_arguments(inner: dict[str, Any]) -> dict[str, Any]:
    """ModelParallelStrategy's arguments for an island: FSDP2 over all of its ranks, no tensor
    parallelism (Lightning's default would give the nodes' devices to it)."""
    inner = {"tensor_parallel_size": 1, **inner}
    if inner["tensor_parallel_size"] != 1:
        raise ValueError(
            f"tensor_parallel_size={inner['tensor_parallel_size']}: tensor parallelism inside an island is not supported yet; "
            "use tensor_parallel_size=1 (FSDP2 over all of the island's devices)"
        )
    return inner


def reshard(module: torch.nn.Module) -> None:
    """FSDP2 keeps the root module's gathered parameters after a forward without backward (an
    evaluation); a write into the shards would not reach them. Resharding drops them."""
    from torch.distributed.fsdp import FSDPModule

    for part in module.modules():
        if isinstance(part, FSDPModule):
            part.reshard()


def sharded_learner_state(learner: Any, distributed: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """The learner's outer state for a checkpoint, and the bases to save beside the weights.

    ``distributed``: every rank saves its shards of the base fragments, by parameter name, as
    DTensors placed like the parameters (returned apart, for the strategy to put where its
    framework saves the weights). Otherwise rank 0 saves the whole model: the bases too, gathered
    one fragment at a time into the state (``bases_by_name``; every rank must call this)."""
    state = learner.state_dict()
    bases = state.pop("bases")
    shards, layout = learner.shards, learner.layout
    out: dict[str, torch.Tensor] = {}
    for p, flat in enumerate(bases):
        if distributed:
            for i, local in zip(layout.fragments[p], shards.local_pieces(p, flat)):
                out[layout.specs[i].name] = shards.as_distributed(i, local.clone())
        elif (fragment := shards.gather(p, flat)) is not None:
            specs = layout.fragment_specs(p)
            out.update(zip((s.name for s in specs), (t.clone() for t in split_fragment(fragment, specs))))
    if distributed:
        return state, out
    state["bases_by_name"] = out
    return state, {}


def bases_to_load(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Where a distributed checkpoint's base fragments load into, by parameter name: DTensors
    placed like the parameters, in the global model's dtype (fp32) whatever the parameters' own."""
    params = trainable_parameters(module)
    return {s.name: torch.zeros_like(params[s.name].detach(), dtype=torch.float32) for s in tensor_specs(module)}


def bases_from_names(resume: dict, learner: Any) -> dict:
    """A checkpoint's learner state with its bases by parameter name (``bases_by_name``: DTensors
    loaded sharded, or whole tensors) as the learner's flat per-fragment bases of this rank."""
    resume = dict(resume)
    by_name, shards, layout = resume.pop("bases_by_name"), learner.shards, learner.layout
    missing = sorted({s.name for s in layout.specs} - set(by_name))
    if missing:
        raise ValueError(f"the checkpoint holds no base fragments for {missing[:3]}: resume with the same model")
    resume["bases"] = []
    for p in range(layout.num_fragments):
        parts = []
        for i in layout.fragments[p]:
            value = by_name[layout.specs[i].name]
            local = value.to_local() if hasattr(value, "to_local") else shards.local_part(i, value)
            parts.append(local.reshape(-1).to("cpu", torch.float32))
        resume["bases"].append(torch.cat(parts))
    return resume


def write_then_swap(strategy: Any, path: Any, write: Callable[[Path], None]) -> None:
    """``write(partial)`` writes the checkpoint beside the old one, then it is swapped in: a
    distributed checkpoint is a folder its ranks fill file by file, and an island killed while
    saving (a fault, or its launcher's chaos) must still find the previous one whole when it
    restarts. ``strategy``: the Lightning strategy (its broadcast, barrier and rank)."""
    path = Path(strategy.broadcast(path))
    partial, old = path.with_name(path.name + ".partial"), path.with_name(path.name + ".old")
    if strategy.global_rank == 0:
        _remove(partial)
    strategy.barrier()
    write(partial)
    strategy.barrier()
    if strategy.global_rank == 0:
        _remove(old)
        if path.exists():
            path.rename(old)
        partial.rename(path)  # between the two renames (microseconds) there is no checkpoint
        _remove(old)
    strategy.barrier()


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
