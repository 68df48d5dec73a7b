"""The ``sparse`` codec: a chunked top-k of a flat fp32 fragment, 2-bit values, 12-bit indices.

SparseLoCo's encoding (arXiv 2508.15706): the fragment is cut into chunks of ``CHUNK`` = 4096
values and each chunk sends only its k largest values by magnitude, k = round(density * 4096)
(the tail chunk of L < 4096 values: round(density * L)), at least 1. Each sent value is one of
the int2 codec's four levels (-1.5, -0.5, 0.5, 1.5 times the root mean square of the chunk's
sent values, that scale stored as bf16), and its place in the chunk a 12-bit index. Everything
not sent is left to error feedback (core/feedback.py on the uplink, core/downlink.py on the
downlink): this codec is meant to run with it, and nothing trains without it.

Bytes per full chunk: 2 (scale) + 1.5 k (indices) + k / 4 (levels): 114 bytes for 4096 values at
density 1/64, 0.028 bytes a value against int4's 0.53 (block 64), 19x fewer.

Layout: ``nchunks`` bf16 scales; then the K = sum of every chunk's k indices, chunk by chunk,
ascending within each chunk, two to three bytes (low 8 bits of the first, then its high 4 bits in
the low nibble beside the second's low 4 bits, then the second's high 8 bits), K padded to even
with a zero index; then the K levels, four a byte, lowest bits first, stored as level + 1.5,
padded with zeros. The size depends only on the fragment's size and the density, so a payload of
another density is refused by its size, before anything is decoded.

Decode refuses, naming what was wrong: indices not strictly ascending within a chunk (a
duplicate, or an order no encoder writes), an index past the tail chunk's end, non-zero padding,
and non-finite scales. A refused payload changes nothing.

Encode and decode run compiled (core/sparse_kernels.py: numba): the selection is a radix select on
|x|'s bits over the values at or above a threshold from every 16th value of the chunk, set to keep
about 2k of them (every value where fewer than k reach it), then one pass packs the sent indices
and levels. Ties at the k-th value go to the lower index. The scale is the root mean square of the
sent values computed in float64, rounded to fp32 and then to the nearest bf16 (ties to even).
"""

from __future__ import annotations

import fnmatch
import functools
import math
from types import ModuleType

import numpy as np
import torch

from lightning_diloco.core.codecs import Codec, NonFiniteError, Payload, _refuse_non_finite
from lightning_diloco.core.fragments import FragmentLayout

CHUNK = 4096
"""Values per chunk: a 12-bit index addresses each of them."""
SAMPLE_STRIDE = 16
"""Every 16th value of a chunk sets the threshold its candidates reach."""
MIN_DENSITY, MAX_DENSITY = 1 / CHUNK, 0.5
"""The densities the setting takes: at least one value a chunk; past half, int2 dense is fewer bytes."""


DENSE_CODEC = "int2"
"""What a fragment named by ``sparse_dense_tensors`` is sent in, where the codec is sparse (core/config.py)."""


def dense_fragments(layout: FragmentLayout, patterns: str, *, strict: bool = True) -> frozenset[int]:
    """The fragments of ``layout`` holding a tensor that one of ``patterns`` (comma-separated
    ``fnmatch`` patterns of tensor names, the ``sparse_dense_tensors`` setting) matches. With
    ``strict`` (the island's check, at its start) a pattern that matches no tensor is refused,
    naming the tensors: a misspelt name would otherwise leave the fragment sparse without a word."""
    out: set[int] = set()
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        hits = {f for f, members in enumerate(layout.fragments)
                for i in members if fnmatch.fnmatchcase(layout.specs[i].name, pattern)}
        if not hits and strict:
            names = [s.name for s in layout.specs]
            # a name given without the module's prefix (a LightningModule's ``model.``): say which
            prefixed = [n for n in names if fnmatch.fnmatchcase(n, "*." + pattern)]
            hint = f"; did you mean '*.{pattern}' ({prefixed[0]})?" if prefixed else ""
            raise ValueError(f"sparse_dense_tensors pattern {pattern!r} matches no tensor of the model{hint}; its tensors "
                             f"are {', '.join(names[:8])}{', ...' if len(names) > 8 else ''} ({len(names)} in all)")
        out |= hits
    return frozenset(out)


def chunk_k(length: int, density: float) -> int:
    """Values sent of a chunk of ``length`` values."""
    return max(1, min(length, round(density * length)))


class SparseCodec(Codec):
    """Chunked top-k at ``density`` (see the module docstring)."""

    name = "sparse"

    def __init__(self, density: float) -> None:
        if not (isinstance(density, (int, float)) and MIN_DENSITY <= density <= MAX_DENSITY):
            raise ValueError(f"sparse density={density!r} must be a number from 1/{CHUNK} to {MAX_DENSITY}")
        self.density = float(density)
        self.k = chunk_k(CHUNK, self.density)

    def _shape(self, numel: int) -> tuple[int, int, int]:
        """(full chunks, values of the tail chunk (0: none), values sent in all)."""
        nfull, tail = divmod(numel, CHUNK)
        total = nfull * self.k + (chunk_k(tail, self.density) if tail else 0)
        return nfull, tail, total

    def sections(self, numel: int) -> tuple[int, int, int]:
        """Bytes of the payload's three parts: scales, indices, levels."""
        nfull, tail, total = self._shape(numel)
        return 2 * (nfull + (1 if tail else 0)), 3 * math.ceil(total / 2), math.ceil(total / 4)

    def encoded_size(self, numel: int) -> int:
        return sum(self.sections(numel))

    def _ks(self, numel: int) -> tuple[int, int, int]:
        """(values sent a full chunk, values sent of the tail chunk, values sent in all)."""
        nfull, _, total = self._shape(numel)
        return self.k, total - nfull * self.k, total

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1).to(torch.float32).contiguous()
        numel = flat.numel()
        out = torch.zeros(self.encoded_size(numel), dtype=torch.uint8, device="cpu")
        if numel == 0:
            return out
        k, k_tail, _ = self._ks(numel)
        scale_bytes, index_bytes, _ = self.sections(numel)
        kernels = _kernels()
        error = kernels.encode_into(flat.numpy(), k, k_tail, out.numpy(), scale_bytes, scale_bytes + index_bytes)
        if error == kernels.NON_FINITE_INPUT:
            _refuse_non_finite(flat, f"{self.name} input")  # raises, counting them in its message
        if error:  # LEVEL_OVERFLOW
            raise NonFiniteError(f"{self.name} input's largest level overflows: a chunk's values sent have a root "
                                 "mean square near fp32's largest value; refusing to send it")
        return out

    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        raw, _ = self._as_uint8(data, numel)
        out = torch.empty(numel, dtype=torch.float32, device="cpu")
        if numel == 0:
            return out
        kernels = _kernels()
        k, k_tail, total = self._ks(numel)
        scale_bytes, index_bytes, _ = self.sections(numel)
        where = np.zeros(2, dtype=np.int64)
        error = kernels.decode_into(raw.numpy(), k, k_tail, scale_bytes, scale_bytes + index_bytes, total, out.numpy(), where)
        if error == kernels.SCALE_NON_FINITE:
            raise NonFiniteError(f"{self.name} payload scale of chunk {where[0]} is non-finite (NaN or inf, or its "
                                 "largest level is); refusing to merge it")
        if error == kernels.PADDING_INDEX:
            raise ValueError(f"{self.name} payload's padding index is not zero; it was not written by this codec")
        if error == kernels.PADDING_LEVELS:
            raise ValueError(f"{self.name} payload's padding levels are not zero; it was not written by this codec")
        last = where[0] == (numel - 1) // CHUNK and numel % CHUNK
        if error == kernels.NOT_ASCENDING:
            raise ValueError(f"{self.name} payload has indices not strictly ascending within "
                             f"{'its last chunk' if last else 'a chunk'} (a duplicate or a reordered "
                             "index); it was not written by this codec")
        if error == kernels.PAST_TAIL:
            raise ValueError(f"{self.name} payload has index {where[1]} past its last chunk of {numel % CHUNK} "
                             f"values (a fragment of {numel} values)")
        return out

    def __repr__(self) -> str:
        return f"SparseCodec(density={self.density})"



@functools.cache
def prepare_kernels() -> None:
    """Loads the kernels, or compiles them where this machine has not yet (about 4 s), for each
    kind of argument a run passes them (a payload in memory and one off the wire, read-only): an
    island or a synchronizer whose run is sparse calls this as it starts. Once a process: a
    synchronizer builds a state for every checkpoint's snapshot, and each call is 80 us of codec
    work. Compiled at the first push instead, four islands starting together on 2 cores lost 11 s
    of rounds and 7% of their sends (2026-11-29)."""
    codec = SparseCodec(MAX_DENSITY)
    x = torch.linspace(-1.0, 1.0, CHUNK + 1)
    payload = codec.encode(x)
    codec.decode(payload, x.numel())
    codec.decode(bytes(payload.numpy()), x.numel())


def _kernels() -> ModuleType:
    """core/sparse_kernels.py, imported at the first encode or decode: numba and the cached
    kernels load in about a second, which a run on the other codecs need not pay."""
    try:
        from lightning_diloco.core import sparse_kernels
    except ImportError as err:  # a machine where lightning-diloco's dependencies were not installed
        raise ImportError(f"the sparse codec runs compiled kernels that need numba ({err}); install it with "
                          "`pip install numba` (a dependency of lightning-diloco)") from err
    return sparse_kernels
