"""The synchronizer's global state: fragments, versions, history, outer momentum, rounds.

Its checkpoints are plain tensors, numbers and strings (loadable with ``weights_only=True``),
written and verified by core/checkpoints.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from lightning_diloco.core import checkpoints
from lightning_diloco.core.codecs import NonFiniteError, get_codec
from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.downlink import PublishedChain, whole
from lightning_diloco.core.fragments import FragmentLayout, flatten_fragment
from lightning_diloco.core.merge import norm64
from lightning_diloco.core.outer import OuterOptimizer
from lightning_diloco.core.protocol import VersionUpdate
from lightning_diloco.core.sparse_codec import DENSE_CODEC, dense_fragments, prepare_kernels

CHECKPOINT_FORMAT = 2


def all_finite(x: torch.Tensor) -> bool:
    # NaN propagates through max and an inf lands in max or min: two reductions, no mask
    return x.numel() == 0 or bool(torch.isfinite(x.amax()) & torch.isfinite(x.amin()))


class FragmentState:
    """One global fragment: its current value, its outer momentum, the round of the run the
    synchronizer collects next (-1 before the first send), and what the islands are sent of it.

    With the fp32 downlink an island is sent the current value whole, so it holds that value bit
    for bit (the version log's digest is of it: synchronizer/version_log.py). With a lossy one the
    published chain (core/downlink.py) is kept beside it: the value the islands hold and the steps
    leading to it. ``history`` holds the current exact version only (a checkpoint's format).
    """

    def __init__(self, value: torch.Tensor, config: RunConfig, version: int = 0, downlink: str | None = None) -> None:
        """``downlink``: the codec its versions go to the islands in, where not the run's
        (:meth:`SynchronizerState.downlink_of`)."""
        self.value = value.detach().to(torch.float32).reshape(-1).clone()
        self.version = version
        self.history: dict[int, torch.Tensor] = {version: self.value.clone()}
        self.depth = config.merge.history
        self.outer = OuterOptimizer(self.value, config.outer)
        self.next_round = -1
        codec = config.codec
        self.downlink_codec = get_codec(downlink or codec.downlink, codec.block_size, codec.sparse_density)
        self.published = None if self.downlink_codec.lossless else PublishedChain(self.value, version, self.downlink_codec, self.depth)
        self.publish_hook: Callable[[int, torch.Tensor], None] | None = None
        """Called with each new version and its published value before the version is taken (the
        synchronizer's write-ahead version log, synchronizer/version_log.py); an error it raises
        leaves the state as it was, as any failed step does."""

    def apply(self, outer_gradient: torch.Tensor, share: float = 1.0,
              bound: Callable[[float], float] | None = None) -> int | None:
        """One outer step; publishes and returns the new version. With a lossy downlink the
        published chain keeps what the last S versions (the ``history`` setting, whatever the
        number of islands: keeping one per member measured 2 GB after 2,000 made-up joins) need to
        be sent the new one as steps; an island further behind, and every island with the fp32
        downlink, is sent the value whole.

        A step that would make the value or the momentum non-finite, or that a lossy downlink
        cannot carry (a value near fp32's largest), is not taken: the state stays exactly as it
        was and None is returned. Any other error in the step also leaves the state as it was.
        ``share``: the part of the islands taking part that the step merged (the outer optimizer's).
        ``bound``: given the length the step moves the value (its momentum part included), the
        factor it may take of it (core/step_budget.py; below 1 the step and the momentum are
        scaled by it); called once, before the step is published.
        """
        saved = (self.value.clone(), self.outer.state_dict())
        chain = self.published
        # the chain's value is replaced, never changed in place: its fields are all a rollback needs
        saved_chain = None if chain is None else (chain.value, chain.version, chain.first, dict(chain.steps))
        try:
            self.outer.step(outer_gradient, share)
            if bound is not None:
                self._bound_movement(saved[0], bound)
            momentum = self.outer.momentum_buffer
            if not (all_finite(self.value) and (momentum is None or all_finite(momentum))):
                raise NonFiniteError("the outer step is not finite")
            exact = self.value.clone()
            if self.published is not None:  # a value its codec cannot carry is not taken either
                self.published.advance(self.value, self.version + 1)  # (an int2 block rms past 2.27e38)
            if self.publish_hook is not None:  # last: durable before any caller can see the version
                self.publish_hook(self.version + 1, self.published_value_view())
        except BaseException as err:
            # any error, not only a step that is not finite, leaves the state as it was: the
            # round's closer looks again after an error and must not step twice (closers.py)
            self.value.copy_(saved[0])
            self.outer.load_state_dict(saved[1])
            if chain is not None and saved_chain is not None:  # saved whenever there is a chain
                chain.value, chain.version, chain.first, chain.steps = saved_chain
            if isinstance(err, NonFiniteError):
                return None
            raise
        self.version += 1
        self.history = {self.version: exact}  # never changed in place: the fp32 downlink's whole payload shares it
        return self.version

    def _bound_movement(self, before: torch.Tensor, bound: Callable[[float], float]) -> None:
        """Scale the outer step just taken (from ``before``) by ``bound(its length)`` where that is
        below 1: the value moves that part of the way, and the momentum is scaled alike, so the
        next steps do not carry on what this one was not allowed to take."""
        moved = self.value - before
        scale = bound(norm64(moved))
        if scale < 1.0:
            self.value.copy_(before).add_(moved, alpha=scale)
            state = self.outer.state_dict()
            for key in ("momentum", "pending"):
                if state[key] is not None:
                    state[key] = state[key] * scale
            self.outer.load_state_dict(state)

    def downlink(self, fragment: int, have: int) -> list[VersionUpdate]:
        """What an island holding version ``have`` of this fragment (``fragment``) is sent to hold
        the current version: nothing when it has it, a lossy codec's chain of steps, or the value
        whole. Their ``round`` and ``included`` are the rounds' to fill in.

        The fp32 downlink sends the value whole, never a delta: as many bytes as an fp32 delta, and
        the island holds the exact value. An fp32 delta added to the island's copy is that value
        only where the subtraction was exact: where a weight changes sign or binade it is a
        rounding off, and the error walks on with each delta (weights of about 0.05 stepping 1e-3:
        0.9% of the elements after one version, 2.5% after 10, up to 2e-9 apart), so an island
        never gave a version back against the version log's digest (issue 48, 4(a))."""
        if self.published is not None:
            return self.published.updates(fragment, have)
        if have == self.version:
            return []
        return [whole(fragment, self.history[self.version], self.version)]

    def published_value(self) -> torch.Tensor:
        """A copy of the current version as the islands hold it: what a pull gets."""
        return self.published_value_view().clone()

    def published_value_view(self) -> torch.Tensor:
        """The current version as the islands hold it, not copied: only to read, under the fragment's lock."""
        return self.value if self.published is None else self.published.value

    def recover(self, value: torch.Tensor, version: int) -> None:
        """Take ``value``, the published value of ``version`` an island held, as this fragment's
        version (a restart that lost it: service.py). It becomes the exact value too: with a lossy
        downlink the exact one differed from it by at most one quantisation step (the residual the
        next step would have carried), which is lost. The outer momentum stays this state's."""
        self.value.copy_(value.reshape(-1))
        self.version = version
        self.history = {version: self.value.clone()}
        if self.published is not None:  # every island holding ``version`` holds this value: steps go on from it
            self.published = PublishedChain(self.value, version, self.downlink_codec, self.depth)

    def state_dict(self) -> dict:
        return {
            "version": self.version,
            "history": dict(self.history),
            **self.outer.state_dict(),  # the momentum, and the delayed form's gathered part
            "next_round": self.next_round,
            "published": None if self.published is None else self.published.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        version = int(state["version"])
        history = {int(v): t.to(torch.float32) for v, t in state["history"].items()}
        assert version in history, f"checkpoint lacks the current version {version}"
        self.version = version
        self.history = {version: history[version].clone()}  # older checkpoints kept S versions: no longer needed
        self.value.copy_(history[version])
        self.outer.load_state_dict(state)
        self.next_round = int(state.get("next_round", -1))
        if self.published is not None:  # none saved before chains existed: islands are sent whole values once
            self.published = PublishedChain.from_state_dict(state.get("published"), self.value, version,
                                                            self.downlink_codec, self.depth)


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
        self.dense_downlink = (dense_fragments(layout, config.codec.sparse_dense_tensors, strict=False)
                               if config.codec.downlink == "sparse" and config.codec.sparse_dense_tensors else frozenset())
        if "sparse" in (config.codec.uplink, config.codec.downlink):
            prepare_kernels()  # before the first merge
        self.fragments = {p: self.new_fragment(p, value) for p, value in sorted(fragments.items())}
        self.identity: dict = {}
        """Whose state this is: ``run_id``, ``shard``, ``num_shards`` (checkpoints.py checks them on load)."""
        self.num_islands = 0
        """The run's island count, the operator's or its first island's that said one (0: not yet,
        or a checkpoint of an older version): a restart keeps refusing islands started with another."""
        self.left: list[int] = []
        """Islands that left the run (and have not joined since): a restart keeps them out of the quorum."""
        self.memory: dict[int, dict] = {}
        """Per fragment, what its rounds remember besides the value (plain numbers and strings,
        the synchronizer's to read): a restart that lost it reset the influence bounds to their
        first round's and forgot which contributions were merged."""

    def downlink_of(self, p: int) -> str:
        """The codec fragment ``p``'s versions go to the islands in: the run's, or int2 for a
        fragment ``sparse_dense_tensors`` names when the downlink is sparse (its island decodes
        each version in the codec the version names)."""
        return DENSE_CODEC if p in self.dense_downlink else self.config.codec.downlink

    def new_fragment(self, p: int, value: torch.Tensor, version: int = 0) -> FragmentState:
        """Fragment ``p`` at ``value``, as ``version``."""
        return FragmentState(value, self.config, version, downlink=self.downlink_of(p))

    @property
    def outer_steps(self) -> int:
        """Outer steps taken: each one adds 1 to its fragment's version, which starts at 0."""
        return sum(f.version for f in self.fragments.values())

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
        self.fragments[p] = self.new_fragment(p, value)
        return True

    def versions(self) -> dict[int, int]:
        return {p: f.version for p, f in self.fragments.items()}

    def state_dict(self) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "config": self.config.to_dict(),
            "layout": self.layout.to_dict(),
            "outer_steps": self.outer_steps,
            "fragments": {p: f.state_dict() for p, f in self.fragments.items()},
            "identity": dict(self.identity),
            "num_islands": self.num_islands,
            "left": list(self.left),
            "memory": {p: m for p, m in self.memory.items() if p in self.fragments},
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
        out.identity = dict(state.get("identity", {}))  # none in checkpoints of older versions
        out.num_islands = int(state.get("num_islands", 0))  # (nor this)
        out.left = sorted({int(i) for i in state.get("left", []) if 0 <= int(i)})  # (nor this)
        out.memory = {int(p): m for p, m in state.get("memory", {}).items()}  # (nor this)
        return out

    def summary(self) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "saved_at_unix": time.time(),
            "layout_hash": self.layout.hash,
            "identity": dict(self.identity),
            "num_islands": self.num_islands,
            "outer_steps": self.outer_steps,
            "versions": {str(p): v for p, v in self.versions().items()},
            "config": self.config.to_dict(),
        }

    def save(self, directory: str | os.PathLike) -> Path:
        """Write a checksummed checkpoint into ``directory`` (the last few are kept)."""
        return checkpoints.save(self.state_dict(), self.summary(), directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, *, tidy: bool = True) -> SynchronizerState | None:
        """The newest valid checkpoint in ``directory``, or None when there is none (ValueError
        when there are checkpoints and none is valid). ``tidy=False``: only read (checkpoints.py)."""
        return checkpoints.load(directory, cls.from_state_dict, tidy=tidy)


def shard_of(fragment: int, num_shards: int) -> int:
    """The synchronizer shard that owns ``fragment``: fragments are dealt round-robin."""
    return fragment % num_shards


def owned_by_shard(shard: int, num_shards: int) -> Callable[[int], bool]:
    """Whether shard ``shard`` of ``num_shards`` owns a fragment."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard index {shard} must be in [0, {num_shards})")
    return lambda p: shard_of(p, num_shards) == shard

