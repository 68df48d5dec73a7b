"""Balanced tensor fragmentation: which parameters travel together.

The layout is a pure function of the model's (name, shape, dtype, role) list and P, so every
island computes the same one; its hash is compared when an island joins. The names and the dtype
are those of the global model, not of one island's copy of it, so islands that wrap or cast the
same model differently join one run (:func:`canonical_name`, :data:`GLOBAL_DTYPE`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

EMBEDDING = "embedding"
DENSE = "dense"
ROLES = (EMBEDDING, DENSE)
DTYPES = ("float32", "float16", "bfloat16", "float64")
GLOBAL_DTYPE = "float32"
"""The dtype of the global model, of every fragment on the wire and of the islands' bases: a
bf16 island's parameters are read into it and written back from it (rounding once, at the write),
so its progress is never rounded by a bf16 base and it shares the layout of an fp32 island."""
WRAPPER_SEGMENTS = frozenset({
    "_orig_mod",  # torch.compile(module): an OptimizedModule holding the original
    "_checkpoint_wrapped_module",  # torch.distributed's checkpoint_wrapper and offload_wrapper
    "_fsdp_wrapped_module",  # FSDP1's FullyShardedDataParallel (FSDP2's fully_shard adds none)
})
"""Parts of a parameter's dotted name that a wrapper adds around the user's module: not part of
the model's own names, so :func:`canonical_name` drops them."""
MAX_TENSORS = 100_000
MAX_PARAMETERS = 10**12  # a trillion: far beyond one run's model, far below what overflows anything


@dataclass(frozen=True)
class TensorSpec:
    """One trainable tensor as the layout sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str

    def __post_init__(self) -> None:
        name = self.name[:100]
        if not self.name or len(self.name) > 1000:
            raise ValueError(f"tensor name {name!r} must be 1 to 1000 characters")
        if self.role not in ROLES:
            raise ValueError(f"tensor {name!r} has role {self.role[:40]!r}; expected one of {ROLES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {self.dtype[:40]!r}; expected one of {DTYPES}")
        if len(self.shape) > 8 or any(d < 1 for d in self.shape):
            raise ValueError(f"tensor {name!r} has shape {self.shape[:9]}; expected at most 8 dimensions, each >= 1")
        if self.numel > MAX_PARAMETERS:
            raise ValueError(f"tensor {name!r} has {self.numel} elements; more than {MAX_PARAMETERS} is not a model")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "role": self.role}

    @classmethod
    def from_dict(cls, data: dict) -> TensorSpec:
        return cls(name=data["name"], shape=tuple(int(d) for d in data["shape"]), dtype=data["dtype"], role=data["role"])


def canonical_name(name: str) -> str:
    """A parameter's name in the global model: ``name`` without the segments wrappers add
    (:data:`WRAPPER_SEGMENTS`, anywhere in the dotted path), so
    ``model._orig_mod.layers.0._checkpoint_wrapped_module.weight`` is ``model.layers.0.weight``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def trainable_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Canonical name -> the module's own live Parameter, for its trainable parameters in
    registration order (a tensor tied to another is listed once, under its first name)."""
    out: dict[str, nn.Parameter] = {}
    given: dict[str, str] = {}  # canonical name -> the module's own name for it
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        canonical = canonical_name(name)
        if canonical in given:
            raise ValueError(f"parameters {given[canonical]!r} and {name!r} are both {canonical!r} once the wrapper "
                             f"segments {sorted(WRAPPER_SEGMENTS)} are dropped; rename one of the modules holding them")
        given[canonical] = name
        if str(param.dtype).removeprefix("torch.") not in DTYPES:
            raise ValueError(f"trainable parameter {name!r} has dtype {param.dtype}; expected one of {DTYPES} "
                             "(freeze it with requires_grad_(False) to leave it out of synchronization)")
        out[canonical] = param
    return out


def tensor_specs(module: nn.Module) -> list[TensorSpec]:
    """The trainable parameters of ``module`` in registration order, with their roles, under their
    canonical names and in the global dtype: the same list for the model however an island wraps
    it (``torch.compile``, activation checkpointing) and whatever its parameters' dtype.

    A parameter is an ``embedding`` when it is the weight of an ``nn.Embedding`` or the very same
    tensor tied to one (an LM head sharing the input embedding); everything else is ``dense``.
    """
    embedding_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    return [
        TensorSpec(
            name=name,
            shape=tuple(param.shape),
            dtype=GLOBAL_DTYPE,
            role=EMBEDDING if id(param) in embedding_weights else DENSE,
        )
        for name, param in trainable_parameters(module).items()
    ]


@dataclass(frozen=True)
class FragmentLayout:
    """P fragments, each a tuple of tensor indices into ``specs`` (in spec order)."""

    specs: tuple[TensorSpec, ...]
    fragments: tuple[tuple[int, ...], ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def fragment_specs(self, p: int) -> list[TensorSpec]:
        return [self.specs[i] for i in self.fragments[p]]

    def fragment_numel(self, p: int) -> int:
        return sum(self.specs[i].numel for i in self.fragments[p])

    @property
    def total_numel(self) -> int:
        return sum(s.numel for s in self.specs)

    def to_dict(self) -> dict:
        return {"specs": [s.to_dict() for s in self.specs], "fragments": [list(f) for f in self.fragments]}

    @classmethod
    def from_dict(cls, data: dict) -> FragmentLayout:
        return cls(
            specs=tuple(TensorSpec.from_dict(s) for s in data["specs"]),
            fragments=tuple(tuple(int(i) for i in f) for f in data["fragments"]),
        )

    @cached_property
    def hash(self) -> str:
        """Stable across processes and machines: a digest of the canonical JSON form."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def build_layout(specs: Sequence[TensorSpec], num_fragments: int) -> FragmentLayout:
    """Greedy bin-packing of whole tensors, largest first, each into the lightest fragment.

    Ties break by spec order and lowest fragment index, so the result is deterministic.
    """
    if not specs:
        raise ValueError("the model has no trainable parameters; nothing to synchronize")
    if len(specs) > MAX_TENSORS or sum(s.numel for s in specs) > MAX_PARAMETERS:
        raise ValueError(f"{len(specs)} tensors of {sum(s.numel for s in specs)} parameters in all is beyond any model "
                         f"(at most {MAX_TENSORS} tensors, {MAX_PARAMETERS} parameters)")
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("two trainable tensors have the same name; names identify tensors across islands")
    if num_fragments > len(specs):
        raise ValueError(
            f"num_fragments={num_fragments} exceeds the model's {len(specs)} trainable tensors; "
            f"use num_fragments <= {len(specs)} (tensors are never split)"
        )
    order = sorted(range(len(specs)), key=lambda i: (-specs[i].numel, i))
    loads = [0] * num_fragments
    members: list[list[int]] = [[] for _ in range(num_fragments)]
    for i in order:
        p = min(range(num_fragments), key=lambda q: (loads[q], q))
        members[p].append(i)
        loads[p] += specs[i].numel
    return FragmentLayout(specs=tuple(specs), fragments=tuple(tuple(sorted(m)) for m in members))


def flatten_fragment(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous fp32 vector of a fragment's tensors in host memory, in layout order (a copy)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def split_fragment(flat: torch.Tensor, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``specs`` (inverse of :func:`flatten_fragment`)."""
    expected = sum(s.numel for s in specs)
    assert flat.numel() == expected, f"{flat.numel()=} != {expected=}"
    out, start = [], 0
    for spec in specs:
        out.append(flat[start : start + spec.numel].view(spec.shape))
        start += spec.numel
    return out
