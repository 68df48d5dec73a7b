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

Encode selects exactly the top k of each chunk without a full top-k (``torch.topk`` over rows of
4096 ran at 80 MB/s here), and where k is small without a pass over the whole chunk to find
candidates. At k <= 128 (density <= 1/32) the chunk is read as 256 columns of 16 values (column c
holds values c, c + 256, ...; at 64 < k <= 128, 512 columns of 8). The k-th largest column
maximum is a threshold at or below the k-th largest value, and every value at or above it lies in
one of the k columns whose maxima reach it, so only those k columns (a quarter of the chunk) are
searched for candidates. At larger k, or where more than k column maxima tie at the threshold, a
threshold from every 16th value of the chunk keeps about twice k candidates. Either way only the
candidates are sorted; a chunk with fewer candidates than k (rare: values tied or laid out in a
stride-16 pattern) is sorted whole. Ties at the k-th value go to the lower index,
deterministically, whichever search ran.
"""

from __future__ import annotations

import fnmatch
import math

import torch

from lightning_diloco.core.codecs import Codec, Payload, _refuse_non_finite, _scratch
from lightning_diloco.core.fragments import FragmentLayout

CHUNK = 4096
"""Values per chunk: a 12-bit index addresses each of them."""
INDEX_BITS = 12
SAMPLE_STRIDE = 16
"""Every 16th value of a chunk estimates its threshold."""
MAX_COLUMN_VALUES, MIN_COLUMN_VALUES = 16, 8
"""Values of a column in the column search: at most 16 (256 columns a chunk, at stride 256); with
fewer than 8 (k > 128) the search did not beat the sample's (2026-11-29)."""
ROWS_AT_ONCE = 64
"""Chunks searched at once: 1 MB of |x| and 256 KB of mask in the thread's scratch (codecs._Scratch)."""
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
        # the column search's columns: as many values each as leave k columns a quarter of the
        # chunk or less, a power of two up to 16
        self.column_values = min(MAX_COLUMN_VALUES, 1 << max(0, (CHUNK // (4 * self.k)).bit_length() - 1))

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

    # ---- encode -------------------------------------------------------------------------------

    def _top_full(self, rows: torch.Tensor) -> torch.Tensor:
        """Indices of the k largest |values| of each row of ``rows`` (n <= ROWS_AT_ONCE, CHUNK),
        ascending within each row: an (n, k) tensor."""
        n, k = rows.shape[0], self.k
        mags = torch.abs(rows, out=_scratch.values(rows.numel()).view(n, CHUNK))
        if self.column_values >= MIN_COLUMN_VALUES:  # a quarter of the chunk or less to search
            found = self._top_by_columns(mags)
            if found is not None:
                return found
        sample = mags[:, ::SAMPLE_STRIDE]
        # the j-th largest of the sample leaves about j * 16 values at or above it: 2k and a margin
        j = min(sample.shape[1], math.ceil(2 * k / SAMPLE_STRIDE) + 4)
        threshold = sample.topk(j, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
        mask = torch.ge(mags, threshold, out=_scratch.levels(rows.numel()).view(torch.bool).view(n, CHUNK))
        flat = mask.view(-1).nonzero().squeeze(1)  # candidates, row by row, ascending within a row
        row = flat >> INDEX_BITS
        counts = torch.bincount(row, minlength=n)
        short = counts < k
        if bool(short.any()):  # too few candidates: those chunks are searched whole (rare)
            whole = short.nonzero().squeeze(1)
            out = torch.empty(n, k, dtype=torch.int64)
            out[whole] = _top_whole(mags[whole], k)
            rest = (~short).nonzero().squeeze(1)
            if rest.numel():
                out[rest] = self._top_full(rows[rest])
            return out
        return self._first_k(row, mags.view(-1)[flat], flat & (CHUNK - 1), counts)

    def _top_by_columns(self, mags: torch.Tensor) -> torch.Tensor | None:
        """``_top_full``'s result from the k columns whose maxima are largest (module docstring),
        or None where more than k column maxima reach the threshold (ties), which the sample's
        search handles."""
        n, k, height = mags.shape[0], self.k, self.column_values
        width = CHUNK // height
        columns = mags.view(n, height, width)
        peaks = columns.amax(dim=1)
        best, which = peaks.topk(k, dim=1, sorted=False)
        threshold = best.amin(dim=1, keepdim=True)
        if bool((peaks >= threshold).sum(dim=1).gt(k).any()):
            return None  # a column left out could hold a value tied at the threshold
        candidates = columns.gather(2, which[:, None, :].expand(n, height, k))  # (n, height, k)
        flat = (candidates >= threshold[:, :, None]).view(-1).nonzero().squeeze(1)
        row = flat // (height * k)
        place = (flat // k) % height * width + which.view(-1)[row * k + flat % k]
        return self._first_k(row, candidates.view(-1)[flat], place, torch.bincount(row, minlength=n))

    def _first_k(self, row: torch.Tensor, mags: torch.Tensor, place: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The k largest of each row's candidates (``row``, ``mags``, ``place`` in the chunk, at least
        k a row, ``counts`` of them), ascending by place: one sort by row, then magnitude largest
        first, then place. |x|'s bits order as |x| does and the key is unique, so ties go to the
        lower place whatever the sort and whatever order the candidates come in."""
        bits = mags.view(torch.int32).to(torch.int64)
        key = (row << (31 + INDEX_BITS)) | ((0x7FFFFFFF - bits) << INDEX_BITS) | place
        key = key.sort().values
        starts = torch.cumsum(counts, 0) - counts
        chosen = key[starts[:, None] + torch.arange(self.k)] & (CHUNK - 1)  # the first k of each row
        return chosen.sort(dim=1).values

    def _groups(self, numel: int) -> list[tuple[int, int, int, int]]:
        """(first value, chunks, values a chunk, values sent a chunk): the full chunks, then the tail."""
        nfull, tail, total = self._shape(numel)
        groups = [(0, nfull, CHUNK, self.k)] if nfull else []
        return groups + ([(nfull * CHUNK, 1, tail, total - nfull * self.k)] if tail else [])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1).to(torch.float32)
        numel = flat.numel()
        out = torch.zeros(self.encoded_size(numel), dtype=torch.uint8)
        if numel == 0:
            return out
        _refuse_non_finite(flat, f"{self.name} input")
        indices, values = [], []
        for start, rows, length, k in self._groups(numel):
            block = flat[start : start + rows * length].view(rows, length)
            if length == CHUNK:
                index = torch.empty(rows, k, dtype=torch.int64)
                for lo in range(0, rows, ROWS_AT_ONCE):  # scratch of at most that many chunks a thread
                    index[lo : lo + ROWS_AT_ONCE] = self._top_full(block[lo : lo + ROWS_AT_ONCE])
            else:
                index = _top_whole(block.abs(), k)
            indices.append(index)
            values.append(block.gather(1, index))
        # per chunk the root mean square of its sent values (in float64 where fp32 squares could overflow)
        wide = torch.float64 if max(float(v.abs().max()) for v in values) > 1e18 else torch.float32
        scale = torch.cat([torch.linalg.vector_norm(v, dim=1, dtype=wide).div_(v.shape[1] ** 0.5) for v in values])
        scale = scale.to(torch.bfloat16)
        _refuse_non_finite(scale.float() * 1.5, f"{self.name} input's largest level")
        divisor = scale.float()
        divisor = torch.where(divisor > 0, divisor, 1.0)
        levels, row = [], 0
        for v in values:
            levels.append((v / divisor[row : row + v.shape[0], None]).floor_().clamp_(-2, 1).add_(2).view(-1))
            row += v.shape[0]
        scale_bytes, index_bytes, _ = self.sections(numel)
        out[:scale_bytes].view(torch.bfloat16).copy_(scale)
        _pack_indices(torch.cat([i.view(-1) for i in indices]), out[scale_bytes : scale_bytes + index_bytes])
        _pack_levels(torch.cat(levels).to(torch.uint8), out[scale_bytes + index_bytes :])
        return out

    # ---- decode -------------------------------------------------------------------------------

    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        raw, _ = self._as_uint8(data, numel)
        out = torch.zeros(numel, dtype=torch.float32)
        if numel == 0:
            return out
        _, _, total = self._shape(numel)
        scale_bytes, index_bytes, _ = self.sections(numel)
        scale = raw[:scale_bytes].view(torch.bfloat16).to(torch.float32)  # _as_uint8: at an even offset
        _refuse_non_finite(scale * 1.5, f"{self.name} payload scale")
        index = _unpack_indices(raw[scale_bytes : scale_bytes + index_bytes], total)
        levels = _unpack_levels(raw[scale_bytes + index_bytes :], total)
        row = sent = 0
        for start, rows, length, k in self._groups(numel):
            where = index[sent : sent + rows * k].view(rows, k)
            if not bool((where.diff(dim=1) > 0).all()):
                raise ValueError(f"{self.name} payload has indices not strictly ascending within "
                                 f"{'a chunk' if length == CHUNK else 'its last chunk'} (a duplicate or a reordered "
                                 "index); it was not written by this codec")
            if length < CHUNK and int(where.max()) >= length:
                raise ValueError(f"{self.name} payload has index {int(where.max())} past its last chunk of {length} "
                                 f"values (a fragment of {numel} values)")
            value = levels[sent : sent + rows * k].view(rows, k).to(torch.float32).sub_(1.5).mul_(scale[row : row + rows, None])
            out[start : start + rows * length].view(rows, length).scatter_(1, where, value)
            row, sent = row + rows, sent + rows * k
        return out

    def __repr__(self) -> str:
        return f"SparseCodec(density={self.density})"


def _top_whole(mags: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row of ``mags``, ties to the lower index, ascending: a
    stable sort of whole rows (``torch.topk`` leaves ties to its implementation)."""
    return torch.sort(mags, dim=1, descending=True, stable=True).indices[:, :k].sort(dim=1).values


def _pack_indices(index: torch.Tensor, dest: torch.Tensor) -> None:
    """12-bit ``index`` values into ``dest`` (3 bytes a pair, a zero index padding an odd count)."""
    pairs = torch.zeros(dest.numel() // 3 * 2, dtype=torch.int64)
    pairs[: index.numel()] = index
    a, b = pairs[0::2], pairs[1::2]
    row = dest.view(-1, 3)
    row[:, 0] = a & 0xFF
    row[:, 1] = (a >> 8) | ((b & 0xF) << 4)
    row[:, 2] = b >> 4


def _unpack_indices(src: torch.Tensor, count: int) -> torch.Tensor:
    row = src.view(-1, 3).to(torch.int64)
    pairs = torch.empty(row.shape[0] * 2, dtype=torch.int64)
    pairs[0::2] = row[:, 0] | ((row[:, 1] & 0xF) << 8)
    pairs[1::2] = (row[:, 1] >> 4) | (row[:, 2] << 4)
    if pairs.numel() > count and int(pairs[count]) != 0:
        raise ValueError("sparse payload's padding index is not zero; it was not written by this codec")
    return pairs[:count]


def _pack_levels(levels: torch.Tensor, dest: torch.Tensor) -> None:
    padded = torch.zeros(dest.numel() * 4, dtype=torch.uint8)
    padded[: levels.numel()] = levels
    columns = padded.view(-1, 4)
    torch.bitwise_or(columns[:, 0], columns[:, 1] << 2, out=dest)
    dest.bitwise_or_(columns[:, 2] << 4).bitwise_or_(columns[:, 3] << 6)


def _unpack_levels(src: torch.Tensor, count: int) -> torch.Tensor:
    out = torch.empty(src.numel(), 4, dtype=torch.uint8)
    for k in range(4):
        torch.bitwise_right_shift(src, 2 * k, out=out[:, k])
    out.bitwise_and_(3)
    flat = out.view(-1)
    if bool(flat[count:].any()):
        raise ValueError("sparse payload's padding levels are not zero; it was not written by this codec")
    return flat[:count]
