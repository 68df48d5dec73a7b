"""The synchronizer's global state: fragments, versions, history, outer momentum; checkpoints.

A checkpoint is one ``torch.save`` file of plain tensors, numbers and strings (loadable with
``weights_only=True``) plus a readable JSON summary beside it. Both are written atomically:
temporary file, fsync, rename, so a crash mid-write leaves the previous checkpoint in place.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.fragments import FragmentLayout, flatten_fragment
from lightning_diloco.core.outer import OuterOptimizer

CHECKPOINT_FORMAT = 1
CHECKPOINT_NAME = "synchronizer.pt"
SUMMARY_NAME = "synchronizer.json"


class FragmentState:
    """One global fragment: its current value, the last S versions and its outer momentum."""

    def __init__(self, value: torch.Tensor, config: RunConfig, version: int = 0) -> None:
        self.value = value.detach().to(torch.float32).reshape(-1).clone()
        self.version = version
        self.history: dict[int, torch.Tensor] = {version: self.value.clone()}
        self.depth = config.merge.history
        self.delta_vs_own_base = config.merge.delta_vs_own_base
        self.outer = OuterOptimizer(self.value, config.outer)

    def base(self, version: int) -> torch.Tensor | None:
        """The fragment at ``version`` if still kept, else None (stale or from the future)."""
        return self.history.get(version)

    def outer_gradient(self, base_version: int, delta: torch.Tensor) -> torch.Tensor:
        """Delta_m = Theta_ref - theta_m, with theta_m = Theta_base + d. Overwrites ``delta``.

        Theta_ref is the current global fragment (paper) or the island's own base; when the
        island's base is the reference (the common case) this is just -d.
        """
        out = delta.neg_()
        if not self.delta_vs_own_base and base_version != self.version:
            out.add_(self.value).sub_(self.history[base_version])
        return out

    def apply(self, outer_gradient: torch.Tensor) -> int:
        """One outer step; publishes and returns the new version."""
        self.outer.step(outer_gradient)
        self.version += 1
        self.history[self.version] = self.value.clone()
        for old in [v for v in self.history if v <= self.version - self.depth]:
            del self.history[old]
        return self.version

    def state_dict(self) -> dict:
        return {
            "version": self.version,
            "history": dict(self.history),
            "momentum": self.outer.momentum_buffer,
        }

    def load_state_dict(self, state: dict) -> None:
        version = int(state["version"])
        history = {int(v): t.to(torch.float32) for v, t in state["history"].items()}
        assert version in history, f"checkpoint lacks the current version {version}"
        self.version = version
        self.history = {v: t.clone() for v, t in history.items()}
        self.value.copy_(history[version])
        self.outer.momentum_buffer = state["momentum"]


class SynchronizerState:
    """The fragments one synchronizer shard owns (all of them with one shard).

    A fragment exists once seeded: from a checkpoint, from the parameters given here, or by the
    first island that joins a fresh synchronizer (:meth:`seed`).
    """

    def __init__(self, config: RunConfig, layout: FragmentLayout, fragments: dict[int, torch.Tensor]) -> None:
        self.config, self.layout = config, layout
        for p, value in fragments.items():
            expected = layout.fragment_numel(p)
            assert value.numel() == expected, f"fragment {p}: {value.numel()=} != {expected=}"
        self.fragments = {p: FragmentState(value, config) for p, value in sorted(fragments.items())}
        self.outer_steps = 0

    @classmethod
    def from_parameters(
        cls,
        config: RunConfig,
        layout: FragmentLayout,
        parameters: Sequence[torch.Tensor],
        owned: Callable[[int], bool] = lambda p: True,
    ) -> SynchronizerState:
        """Initial state from a full parameter list in layout spec order."""
        assert len(parameters) == len(layout.specs), f"{len(parameters)=} != {len(layout.specs)=}"
        fragments = {
            p: flatten_fragment([parameters[i] for i in members])
            for p, members in enumerate(layout.fragments)
            if owned(p)
        }
        return cls(config, layout, fragments)

    def seed(self, p: int, value: torch.Tensor) -> bool:
        """Set fragment p's version 0 unless it already exists; True when this call set it."""
        if p in self.fragments:
            return False
        expected = self.layout.fragment_numel(p)
        assert value.numel() == expected, f"fragment {p}: {value.numel()=} != {expected=}"
        self.fragments[p] = FragmentState(value, self.config)
        return True

    def versions(self) -> dict[int, int]:
        return {p: f.version for p, f in self.fragments.items()}

    def apply(self, p: int, outer_gradient: torch.Tensor) -> int:
        self.outer_steps += 1
        return self.fragments[p].apply(outer_gradient)

    def state_dict(self) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "config": self.config.to_dict(),
            "layout": self.layout.to_dict(),
            "outer_steps": self.outer_steps,
            "fragments": {p: f.state_dict() for p, f in self.fragments.items()},
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> SynchronizerState:
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint format {state.get('format')!r} is not {CHECKPOINT_FORMAT}; it was written by another version")
        config = RunConfig.from_dict(state["config"])
        layout = FragmentLayout.from_dict(state["layout"])
        frags = {int(p): f["history"][f["version"]] for p, f in state["fragments"].items()}
        out = cls(config, layout, frags)
        for p, f in state["fragments"].items():
            out.fragments[int(p)].load_state_dict(f)
        out.outer_steps = int(state["outer_steps"])
        return out

    def summary(self) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "saved_at_unix": time.time(),
            "layout_hash": self.layout.hash,
            "outer_steps": self.outer_steps,
            "versions": {str(p): v for p, v in self.versions().items()},
            "config": self.config.to_dict(),
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Atomically write the checkpoint and its JSON summary into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / CHECKPOINT_NAME
        _atomic_write(path, lambda f: torch.save(self.state_dict(), f))
        _atomic_write(directory / SUMMARY_NAME, lambda f: f.write(json.dumps(self.summary(), indent=2).encode()))
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> SynchronizerState | None:
        """The checkpoint in ``directory``, or None when there is none."""
        path = Path(directory) / CHECKPOINT_NAME
        if not path.exists():
            return None
        return cls.from_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def _atomic_write(path: Path, write: Callable) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def owned_by_shard(shard: int, num_shards: int) -> Callable[[int], bool]:
    """Fragment ownership of shard ``shard`` of ``num_shards``: p % num_shards == shard."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard index {shard} must be in [0, {num_shards})")
    return lambda p: p % num_shards == shard

