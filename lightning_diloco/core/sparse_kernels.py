"""The sparse codec's encode and decode, compiled: one pass of selection and packing a chunk.

The rule and the layout are core/sparse_codec.py's; this module is how they run. Written as torch
calls the codec was about ninety small operations for 64 chunks, 0.26-0.66 GB/s of fp32 input
(2026-11-29). numba (LLVM in a wheel: no compiler on the machine) compiles these loops once per
machine and source (``cache=True``: a few seconds; then a process's first encode, numba's import
and the cached loops, takes about a second). They release the GIL, so an island's push thread
encodes beside its training thread.

The decoder reads what islands send and numba checks no bounds: every byte it reads or writes
follows from sizes the codec checked first, and an index is checked before it is written
(tests/core/test_sparse_codec.py fuzzes it compiled with bounds checks).

A chunk's selection: every 16th value's |x| gives a floor that about 2k values reach; one pass
keeps those (every value where fewer than k do: values tied, or the sample holding the largest).
A radix select on the candidates' bits (|x|'s fp32 bits order as |x| does) narrows on the
exponent, then on 8, 8 and 7 bits of the mantissa, until the k-th largest value's bits are known
and, where values tie at them, which of those are sent (the lowest indices). A pass over the
candidates, ascending by index, then writes the sent ones.

Error codes are returned, not raised (numba's exceptions carry no values): core/sparse_codec.py
turns each into the message that names what was wrong.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from lightning_diloco.core.sparse_codec import CHUNK, SAMPLE_STRIDE


def _compiled(function):
    """``function`` compiled, releasing the GIL, and cached on disk: beside this file, else in the
    user's cache directory (or NUMBA_CACHE_DIR). Where nothing is writable numba refuses to cache,
    and each process compiles it again (a few seconds) rather than fail."""
    try:
        return njit(nogil=True, cache=True)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(nogil=True)(function)


NON_FINITE_INPUT, LEVEL_OVERFLOW = 1, 2
"""encode_into's errors."""
SCALE_NON_FINITE, PADDING_INDEX, PADDING_LEVELS, NOT_ASCENDING, PAST_TAIL = 1, 2, 3, 4, 5
"""decode_into's errors."""


@_compiled
def _kth(cand_u, cand_i, c, need, hist, left_u, left_i):  # pragma: no cover - compiled
    """The ``need``-th largest of the ``c`` candidates (bits ``cand_u``, indices ``cand_i``
    ascending): a radix select on the exponent, then the mantissa's bits 22-15, 14-7 and 6-0,
    narrowing the candidates into ``left_*`` (which may be ``cand_*`` themselves) and stopping
    where those left are exactly the ones needed. Returns (its bits, the last index sent among
    the values tied at them: ties go to the lower index)."""
    src_u, src_i = cand_u, cand_i
    for level in range(4):
        if c == need:
            break
        shift = 23 if level == 0 else (15 if level == 1 else (7 if level == 2 else 0))
        width = 0x7F if level == 3 else 0xFF
        hist[:] = 0
        for j in range(c):
            hist[(src_u[j] >> shift) & width] += 1
        b = width
        while hist[b] < need:
            need -= hist[b]
            b -= 1
        d = 0
        for j in range(c):  # without a branch: a quarter of them can be in the bucket
            u = src_u[j]
            left_u[d] = u
            left_i[d] = src_i[j]
            d += ((u >> shift) & width) == b
        c = d
        src_u, src_i = left_u, left_i
    # every candidate left is needed (c == need), or all of them tie (after the last level)
    threshold = src_u[0]
    for j in range(c):
        threshold = min(threshold, src_u[j])
    return threshold, (src_i[need - 1] if c > need else CHUNK)


@_compiled
def _select(bits, base, length, k, hist, cand_u, cand_i, work_u, work_i, chosen):  # pragma: no cover - compiled
    """Writes the chunk's k sent indices into ``chosen``, ascending; -1 if a value is not finite.

    Candidates are the values at or above a threshold from every 16th value, set to keep about
    2k; where fewer than k reach it (values tied, or the sample holding the largest), every value is one."""
    sample = (length + SAMPLE_STRIDE - 1) // SAMPLE_STRIDE
    j_th = min(sample, (2 * k + SAMPLE_STRIDE - 1) // SAMPLE_STRIDE + 4)
    for j in range(sample):
        work_u[j] = bits[base + j * SAMPLE_STRIDE] & 0x7FFFFFFF
        work_i[j] = j
    floor, _ = _kth(work_u, work_i, sample, j_th, hist, work_u, work_i)
    c = 0
    bad = False
    for i in range(length):
        u = bits[base + i] & 0x7FFFFFFF
        bad |= u >= 0x7F800000  # inf or NaN
        cand_u[c] = u
        cand_i[c] = i
        c += u >= floor
    if bad:
        return -1
    if c < k:
        for i in range(length):
            cand_u[i] = bits[base + i] & 0x7FFFFFFF
            cand_i[i] = i
        c = length
    threshold, last = _kth(cand_u, cand_i, c, k, hist, work_u, work_i)
    n = 0
    for j in range(c):
        u, i = cand_u[j], cand_i[j]
        chosen[n] = i
        n += (u > threshold) | ((u == threshold) & (i <= last))
    return n


@_compiled
def encode_into(values, k, k_tail, out, index_at, level_at):  # pragma: no cover - compiled
    """Encodes fp32 ``values`` into the zeroed payload ``out`` (uint8; its indices from byte
    ``index_at``, its levels from ``level_at``). Returns 0 or an error code."""
    bits = values.view(np.uint32)
    numel = values.size
    hist = np.empty(256, np.int64)
    cand_u, work_u = np.empty(CHUNK, np.uint32), np.empty(CHUNK, np.uint32)
    cand_i, work_i = np.empty(CHUNK, np.int64), np.empty(CHUNK, np.int64)
    chosen = np.empty(CHUNK, np.int64)
    word = np.empty(1, np.float32)  # a float32's bits, for the bf16 rounding
    sent = 0
    for c in range((numel + CHUNK - 1) // CHUNK):
        base = c * CHUNK
        length = min(CHUNK, numel - base)
        k_here = k if length == CHUNK else k_tail
        if _select(bits, base, length, k_here, hist, cand_u, cand_i, work_u, work_i, chosen) < 0:
            return NON_FINITE_INPUT
        total = 0.0
        for t in range(k_here):
            v = np.float64(values[base + chosen[t]])
            total += v * v
        # the root mean square of the sent values (float64, then fp32), rounded to nearest even bf16
        word[0] = np.float32(math.sqrt(total / k_here))
        w = word.view(np.uint32)[0]
        scale_bits = (w + np.uint32(0x7FFF) + ((w >> 16) & np.uint32(1))) >> 16
        word.view(np.uint32)[0] = scale_bits << 16
        scale = word[0]
        if not np.isfinite(np.float32(scale * np.float32(1.5))):
            return LEVEL_OVERFLOW
        out[2 * c] = scale_bits & 0xFF
        out[2 * c + 1] = scale_bits >> 8
        divisor = scale if scale > 0 else np.float32(1.0)
        for t in range(k_here):
            i = chosen[t]
            j = sent + t
            at = index_at + 3 * (j >> 1)
            if j & 1:
                out[at + 1] |= (i & 0xF) << 4
                out[at + 2] = i >> 4
            else:
                out[at] = i & 0xFF
                out[at + 1] |= i >> 8
            q = min(max(math.floor(np.float32(values[base + i] / divisor)), -2), 1) + 2
            out[level_at + (j >> 2)] |= q << (2 * (j & 3))
        sent += k_here
    return 0


@_compiled
def decode_into(raw, k, k_tail, index_at, level_at, total, out, where):  # pragma: no cover - compiled
    """Decodes the payload ``raw`` into ``out`` (fp32, every value written). Returns 0 or an
    error code; ``where`` (int64[2]) then holds the chunk and the offending index."""
    numel = out.size
    nchunks = (numel + CHUNK - 1) // CHUNK
    scales = np.empty(nchunks, np.float32)
    word = np.empty(1, np.uint32)
    for c in range(nchunks):
        word[0] = np.uint32(raw[2 * c] | (raw[2 * c + 1] << 8)) << 16
        scales[c] = word.view(np.float32)[0]
        if not np.isfinite(np.float32(scales[c] * np.float32(1.5))):
            where[0] = c
            return SCALE_NON_FINITE
    if total & 1 and (raw[index_at + 3 * (total >> 1) + 1] >> 4 or raw[index_at + 3 * (total >> 1) + 2]):
        return PADDING_INDEX
    for j in range(total, 4 * (raw.size - level_at)):
        if (raw[level_at + (j >> 2)] >> (2 * (j & 3))) & 3:
            return PADDING_LEVELS
    sent = 0
    for c in range(nchunks):
        base = c * CHUNK
        length = min(CHUNK, numel - base)
        k_here = k if length == CHUNK else k_tail
        out[base : base + length] = 0.0
        previous = -1
        for t in range(k_here):
            j = sent + t
            at = index_at + 3 * (j >> 1)
            if j & 1:
                i = (np.int64(raw[at + 1]) >> 4) | (np.int64(raw[at + 2]) << 4)
            else:
                i = np.int64(raw[at]) | ((np.int64(raw[at + 1]) & 0xF) << 8)
            if i <= previous:
                where[0], where[1] = c, i
                return NOT_ASCENDING
            if i >= length:
                where[0], where[1] = c, i
                return PAST_TAIL
            previous = i
            q = (raw[level_at + (j >> 2)] >> (2 * (j & 3))) & 3
            out[base + i] = np.float32(np.float32(q) - np.float32(1.5)) * scales[c]
        sent += k_here
    return 0
