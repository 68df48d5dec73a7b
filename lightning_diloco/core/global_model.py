"""The global model out of a run: its shards put together, named, and loaded into a module.

Every synchronizer shard holds the exact global value of the fragments it owns (core/state.py),
in a running process or in its checkpoint directory. :class:`GlobalModel` puts the shards of one
run together (refusing shards of two runs or layouts, a shard given twice or missing, a fragment
not seeded yet), names its tensors by the layout (the module's own parameter names) and loads
them into a module by the names :func:`~lightning_diloco.core.fragments.trainable_parameters` gives it.

Reading a checkpoint directory here changes nothing in it, so a running synchronizer's
directory can be read (its newest complete checkpoint).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lightning_diloco.core.fragments import FragmentLayout, split_fragment, trainable_parameters
from lightning_diloco.core.state import SynchronizerState, shard_of

SHOWN = 3  # names quoted in a mismatch message


@dataclass(frozen=True)
class ShardModel:
    """What one synchronizer shard holds of the global model."""

    source: str
    """Where it was read: a checkpoint directory or a synchronizer address (for messages)."""
    run_id: str | None
    shard: int
    num_shards: int
    layout: FragmentLayout
    values: dict[int, torch.Tensor]
    """Owned fragment -> its exact global value (fp32, flat); a fragment not seeded yet is absent."""
    versions: dict[int, int]


@dataclass(frozen=True)
class GlobalModel:
    """The run's global model: every fragment's exact value (fp32) and version."""

    layout: FragmentLayout
    values: dict[int, torch.Tensor]
    versions: dict[int, int]
    run_id: str | None

    @classmethod
    def from_shards(cls, shards: Sequence[ShardModel]) -> GlobalModel:
        """The shards of one run put together; ValueError naming the sources that do not fit."""
        if not shards:
            raise ValueError("no shard given: pass every shard's checkpoint directory or address")
        first = shards[0]
        for other in shards[1:]:
            if other.run_id != first.run_id:
                raise ValueError(f"{first.source} is run {first.run_id!r} and {other.source} is run {other.run_id!r}: "
                                 "give the shards of one run only")
            if other.layout.hash != first.layout.hash:
                raise ValueError(f"{first.source} has layout {first.layout.hash} and {other.source} layout "
                                 f"{other.layout.hash}: give the shards of one run only")
            if other.num_shards != first.num_shards:
                raise ValueError(f"{first.source} is one of {first.num_shards} shards and {other.source} one of "
                                 f"{other.num_shards}: give the shards of one run only")
        by_shard: dict[int, ShardModel] = {}
        for shard in shards:
            if shard.shard in by_shard:
                raise ValueError(f"{by_shard[shard.shard].source} and {shard.source} are both shard {shard.shard}: "
                                 "give each shard once")
            by_shard[shard.shard] = shard
        missing = sorted(set(range(first.num_shards)) - set(by_shard))
        if missing:
            raise ValueError(f"the run has {first.num_shards} synchronizer shards and shard(s) {missing} were not given: "
                             "pass every shard's checkpoint directory (or address), one per shard")
        values, versions = {}, {}
        for p in range(first.layout.num_fragments):
            owner = by_shard[shard_of(p, first.num_shards)]
            if p not in owner.values:
                raise ValueError(f"fragment {p} has no value in {owner.source} yet (no island has seeded it): "
                                 "export once the run's islands have started")
            values[p], versions[p] = owner.values[p], owner.versions[p]
        return cls(layout=first.layout, values=values, versions=versions, run_id=first.run_id)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor by its name in the layout (the trained module's parameter names), fp32,
        in the layout's order."""
        named: dict[str, torch.Tensor] = {}
        for p, members in enumerate(self.layout.fragments):
            for i, value in zip(members, split_fragment(self.values[p], self.layout.fragment_specs(p))):
                named[self.layout.specs[i].name] = value.clone()
        return {s.name: named[s.name] for s in self.layout.specs}

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The tensors whose names start with ``prefix``, named without it (a submodule's own
        names: ``prefix="model."`` gives a LightningModule's ``self.model`` names)."""
        return {name[len(prefix):]: t for name, t in self.tensors().items() if name.startswith(prefix)}

    def load_into(self, module: nn.Module, prefix: str | None = None) -> str:
        """Copy the global model into ``module``'s trainable parameters, each cast to its
        parameter's dtype and device; returns the prefix used.

        The module's tensors (by :func:`trainable_parameters`) must be the layout's tensors under
        ``prefix``, exactly and with their shapes: ``""`` for the module that was trained,
        ``"model."`` for its ``self.model``. None: found (:func:`find_prefix`).
        """
        # the module's parameters by the names the layout holds (wrapper segments such as
        # torch.compile's _orig_mod. dropped): one function decides them, for islands and here
        by_name = trainable_parameters(module)
        names = list(by_name)
        prefix = find_prefix([s.name for s in self.layout.specs], names) if prefix is None else prefix
        ours = self.state_dict(prefix)
        missing, extra = [n for n in names if n not in ours], [n for n in ours if n not in set(names)]
        if missing or extra:
            raise ValueError(f"the module does not match the run's layout {self.layout.hash} under prefix {prefix!r}: "
                             + _difference(missing, extra) + "; load into a module built as the trained one was (the "
                             "same model and config)")
        for name, param in by_name.items():
            value = ours[name]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"tensor {name!r} is {tuple(value.shape)} in the run and {tuple(param.shape)} in "
                                 "the module: build the module with the trained model's config")
        with torch.no_grad():
            for name, param in by_name.items():
                param.copy_(ours[name].to(param.dtype))
        return prefix


def _difference(missing: list[str], extra: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} of the module's tensors are not in the run (e.g. {missing[:SHOWN]})")
    if extra:
        parts.append(f"{len(extra)} of the run's are not in the module (e.g. {extra[:SHOWN]})")
    return " and ".join(parts)


def find_prefix(layout_names: Sequence[str], module_names: Sequence[str]) -> str:
    """The prefix under which the layout's tensors are exactly the module's: ``""`` for the
    module that was trained; the attribute path ending in ``.`` of a submodule of it (a
    LightningModule's ``self.model`` gives ``"model."``). ValueError when none or several fit."""
    if not module_names:
        raise ValueError("the module has no trainable parameters: nothing of the global model can go into it")
    wanted = set(module_names)
    candidates = {name[: len(name) - len(module_names[0])] for name in layout_names if name.endswith(module_names[0])}
    fits = sorted(c for c in candidates if (c == "" or c.endswith("."))
                  and {n[len(c):] for n in layout_names if n.startswith(c)} == wanted)
    if len(fits) == 1:
        return fits[0]
    if fits:
        raise ValueError(f"the module's tensors are the run's under each of the prefixes {fits}; say which (prefix=, "
                         "or --prefix)")
    raise ValueError(f"the module's tensors (e.g. {list(module_names[:SHOWN])}) are not the run's (e.g. "
                     f"{list(layout_names[:SHOWN])}) under any prefix: the module is not the trained model (another "
                     "model or config), or give the prefix (prefix=, or --prefix)")


def shard_from_checkpoint(directory: str | os.PathLike) -> ShardModel:
    """What one shard's checkpoint directory holds of the global model (its newest valid
    checkpoint); ValueError when the directory is missing or holds none. The directory is only
    read: a synchronizer may be running on it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory {directory} does not exist: give each shard's --checkpoint-dir")
    state = SynchronizerState.load(directory, tidy=False)
    if state is None:
        raise ValueError(f"{directory} holds no synchronizer checkpoint (synchronizer-*.pt): give the directory a "
                         "synchronizer was started with as --checkpoint-dir")
    identity = state.identity
    return ShardModel(source=str(directory), run_id=identity.get("run_id"), shard=int(identity.get("shard", 0)),
                      num_shards=int(identity.get("num_shards", 1)), layout=state.layout,
                      values={p: f.value for p, f in state.fragments.items()}, versions=state.versions())


def from_checkpoints(directories: Sequence[str | os.PathLike]) -> GlobalModel:
    """The global model in the checkpoint directories of a run's shards (one per shard, any order)."""
    return GlobalModel.from_shards([shard_from_checkpoint(d) for d in directories])
