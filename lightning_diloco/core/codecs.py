"""Wire encodings of a flat fp32 fragment: fp32, bf16, and int8/int4/int2 with per-block scales.

Error bounds (per element, x the input, x' the decoded value), tested in tests/core/test_codecs.py:

- ``fp32``: exact.
- ``bf16``: |x - x'| <= 2**-8 * |x| (round to nearest, 8 significant bits).
- ``int8``/``int4``: symmetric levels -q..q (q = 127 or 7) scaled by the block's absmax / q,
  the scale stored as bf16: |x - x'| <= (1 + 2**-8) / 2 * absmax(block) / q.
- ``int2``: the four levels -1.5, -0.5, 0.5, 1.5 times the block's root mean square (the tail
  block's over its own values, not its padding; no zero level: three levels would leave a quarter
  of the 2 bits unused). Values within 2 rms are off by at most (1 + 2**-8) / 2 rms; values
  beyond are clipped to 1.5 rms. On Gaussian blocks of 64 that
  is a relative RMS error of 0.34 (scaling by absmax / 1.5 instead keeps every element within
  absmax / 3 but measures 0.51, and 0.78 on Laplace data against 0.44). No per-element bound and
  no exact zero: an int2 stream is meant to run with error feedback, the next message carrying
  what this one could not (core/feedback.py for the uplink, core/downlink.py for the downlink).

``encode`` returns the payload as a 1-D uint8 tensor (the fp32 codec may share memory with
its input); ``decode`` takes that, or any bytes-like object, and returns an fp32 tensor the
caller owns. A ``bytearray`` or writable ``memoryview`` payload (a buffer just received,
transport/wire.py) is consumed: the result may share its memory, which saves a copy of every fp32
fragment on the synchronizer.

Layout of the quantized forms: ``nblocks`` bf16 scales, then the values (int8: one byte each;
int4: two per byte, low nibble first, stored as q + 8; int2: four per byte, lowest bits first,
stored as q + 1.5). The tail block is zero-padded. Non-finite
input is refused on encode and non-finite output on decode, so a corrupt payload cannot leak NaN
into the global model.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import TypeAlias

import torch

Payload: TypeAlias = "torch.Tensor | bytes | bytearray | memoryview"


def payload_size(payload: Payload) -> int:
    """Bytes of an encoded payload, a uint8 tensor (in-process) or bytes (off the wire)."""
    return payload.numel() if isinstance(payload, torch.Tensor) else len(payload)


EXACT = "fp32"
"""The codec of values that must arrive exactly: seeds, pulls and whole versions."""


class Codec:
    """Encode a flat fp32 tensor to a byte payload and back. Subclasses are stateless.

    ``lossless``: decode(encode(x)) == x for every fp32 x; a lossless uplink needs no error
    feedback and a lossless downlink no published chain (the exact value is the published one)."""

    name: str
    lossless: bool = False

    def encoded_size(self, numel: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        raise NotImplementedError

    def _as_uint8(self, data: Payload, numel: int) -> tuple[torch.Tensor, bool]:
        """(payload as uint8 tensor, whether it may be aliased by the output) after a size check."""
        expected = self.encoded_size(numel)
        size = payload_size(data)
        if size != expected:
            raise ValueError(
                f"{self.name} payload of {size} bytes does not match {numel} values "
                f"(expected {expected} bytes); was it encoded with another codec or shape?"
            )
        if isinstance(data, torch.Tensor):
            assert data.dtype == torch.uint8 and data.dim() == 1, f"{data.dtype=} {data.dim()=}"
            # a view into a larger byte tensor (payloads packed side by side) at an offset that is
            # no whole number of fp32 or bf16 values cannot be viewed as them: decode a copy
            return (data.contiguous() if data.storage_offset() % 4 == 0 else data.clone()), False
        if size == 0:
            return torch.zeros(0, dtype=torch.uint8, device="cpu"), True
        with warnings.catch_warnings():  # decoding reads the received bytes and never writes to them
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            consumed = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
            return torch.frombuffer(data, dtype=torch.uint8), consumed

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NonFiniteError(ValueError):
    """Input or output with NaN or inf values: never sent, never merged."""


def _refuse_non_finite(x: torch.Tensor, what: str) -> None:
    # NaN propagates through max and an inf lands in max or min: two cheap reductions instead of
    # a full isfinite pass; the exact count is only computed on the error path.
    if x.numel() and not (bool(torch.isfinite(x.amax())) and bool(torch.isfinite(x.amin()))):
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteError(f"{what} has {bad} non-finite value(s) (NaN or inf); refusing to send or merge them")


class FloatCodec(Codec):
    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.lossless = dtype == torch.float32
        self.itemsize = torch.empty(0, dtype=dtype).element_size()

    def encoded_size(self, numel: int) -> int:
        return numel * self.itemsize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        _refuse_non_finite(flat, f"{self.name} input")
        return flat.to(self.dtype).contiguous().view(torch.uint8)

    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        raw, may_alias = self._as_uint8(data, numel)
        out = raw.view(self.dtype).to(torch.float32, copy=not may_alias)
        _refuse_non_finite(out, f"decoded {self.name} payload")
        return out

    def __repr__(self) -> str:
        return f"FloatCodec({self.name!r})"


class _Scratch(threading.local):
    """One thread's reused work buffers for the block codecs.

    A fresh multi-MB temporary per call is not free: the allocator hands back memory it took from
    the kernel, and each first touch of a 4 KB page is a fault (about 5 us each here). On a 210K
    value fragment that was 2.4 ms of a 3.7 ms int4 encode; buffers kept per thread (a push pool
    thread, a closer) are touched once. Per thread at most 5 bytes per ``chunk_values`` value
    after an encode, 1 after only decodes (a gRPC worker of the synchronizer, of which there are
    up to 256, keeps 256 KB, not 1.25 MB).
    """

    def __init__(self) -> None:
        self._values = torch.empty(0, dtype=torch.float32, device="cpu")
        self._levels = torch.empty(0, dtype=torch.uint8, device="cpu")

    def values(self, n: int) -> torch.Tensor:
        """n fp32 values, reused: the caller's until its next ``values``."""
        if self._values.numel() < n:
            with torch.inference_mode(False):  # see levels()
                self._values = torch.empty(n, dtype=torch.float32, device="cpu")
        return self._values[:n]

    def levels(self, n: int) -> torch.Tensor:
        """n uint8 levels, reused: the caller's until its next ``levels``."""
        if self._levels.numel() < n:
            # a normal tensor even when made under inference_mode (Lightning validates under it):
            # an inference tensor could not be written outside it, on every later call of the thread
            with torch.inference_mode(False):
                self._levels = torch.empty(n, dtype=torch.uint8, device="cpu")
        return self._levels[:n]


_scratch = _Scratch()


class BlockQuantCodec(Codec):
    """Symmetric per-block quantization to ``bits`` (8, 4 or 2) with bf16 scales.

    Values are processed in chunks through reused scratch buffers (:class:`_Scratch`): the
    arithmetic is trivial, and fresh multi-MB temporaries would cost more than the math.
    """

    chunk_values = 1 << 18

    def __init__(self, bits: int, block_size: int = 64) -> None:
        assert bits in (2, 4, 8), f"{bits=}"
        assert block_size >= 4 and block_size % 4 == 0, f"{block_size=}"
        self.bits, self.block_size = bits, block_size
        # top: the largest level in units of the scale; offset: what is added to a level to store
        # it unsigned. int8 and int4 have a zero level (mid-tread), int2 does not (mid-rise).
        self.top = 1.5 if bits == 2 else 2 ** (bits - 1) - 1
        self.offset = {2: 1.5, 4: 8, 8: 0}[bits]
        self.name = f"int{bits}"

    def _num_blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def encoded_size(self, numel: int) -> int:
        nblocks = self._num_blocks(numel)
        return nblocks * 2 + nblocks * self.block_size * self.bits // 8

    def _chunks(self, nblocks: int):
        step = max(1, self.chunk_values // self.block_size)
        for start in range(0, nblocks, step):
            yield start, min(nblocks, start + step)

    def _scales(self, full: torch.Tensor, tail: torch.Tensor | None, tail_values: int) -> torch.Tensor:
        """Each block's scale (its absmax / top; int2: its root mean square), the tail
        block's over its own ``tail_values`` values, not its zero padding (a padded rms would shrink
        the scale and clip them: a 1-value fragment was sent as 0.19 of itself, not 1.5)."""
        rows = [full] if tail is None else [full, tail]
        absmax = torch.cat([torch.maximum(r.amax(dim=1), r.amin(dim=1).neg_()) for r in rows])  # no |x| copy
        _refuse_non_finite(absmax, f"{self.name} input")
        if self.bits != 2:
            return absmax / self.top
        # the rms in float64 only where a sum of fp32 squares could overflow
        wide = torch.float64 if float(absmax.max()) ** 2 * self.block_size > 1e38 else torch.float32
        sizes = [self.block_size] if tail is None else [self.block_size, tail_values]
        return torch.cat([torch.linalg.vector_norm(r, dim=1, dtype=wide).div_(math.sqrt(n)) for r, n in zip(rows, sizes)])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1).to(torch.float32)
        numel = flat.numel()
        out = torch.empty(self.encoded_size(numel), dtype=torch.uint8, device="cpu")
        if numel == 0:
            return out
        nblocks, bs = self._num_blocks(numel), self.block_size
        nfull = numel // bs
        full = flat[: nfull * bs].view(nfull, bs)  # the whole blocks, read in place (no padded copy)
        tail = None
        if nfull < nblocks:  # the last block, zero-padded on its own
            tail = flat.new_zeros(1, bs)  # fp32 whatever torch's default dtype
            tail[0, : numel - nfull * bs] = flat[nfull * bs :]
        scale = self._scales(full, tail, numel - nfull * bs).to(torch.bfloat16)
        _refuse_non_finite(scale.float() * self.top, f"{self.name} input's largest level")  # bf16 rounding up past fp32
        out[: nblocks * 2].view(torch.bfloat16).copy_(scale)
        # Quantize against the rounded scale, so the decoder reconstructs exactly what was meant.
        divisor = scale.to(torch.float32)
        divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))

        body = out[nblocks * 2 :]
        per_byte = 8 // self.bits
        scratch_size = min(nblocks * bs, self.chunk_values) + bs
        values, levels = _scratch.values(scratch_size), _scratch.levels(scratch_size)
        for lo, hi in self._chunks(nblocks):
            n = (hi - lo) * bs
            q = values[:n].view(hi - lo, bs)
            whole = min(hi, nfull) - lo  # rows of this chunk in ``full``; the rest is the tail
            torch.div(full[lo : lo + whole], divisor[lo : lo + whole, None], out=q[:whole])
            if whole < hi - lo:
                assert tail is not None  # rows past ``full`` are the tail's, made above when nfull < nblocks
                torch.div(tail, divisor[-1], out=q[whole:])
            dest = body[lo * bs // per_byte : hi * bs // per_byte]
            if self.bits == 8:
                dest.view(torch.int8).copy_(q.round_().clamp_(-self.top, self.top).view(-1))
                continue
            if self.bits == 2:  # level k + 0.5 for k = floor(x / scale), stored as k + 2
                q.floor_().clamp_(-2, 1).add_(2)
            else:
                q.round_().clamp_(-self.top, self.top).add_(self.offset)
            u = levels[:n]
            u.copy_(q.view(-1))
            columns = u.view(-1, per_byte)  # the values of one byte in a row, lowest bits first
            for k in range(1, per_byte):
                columns[:, k].bitwise_left_shift_(self.bits * k)
            torch.bitwise_or(columns[:, 0], columns[:, 1], out=dest)
            for k in range(2, per_byte):
                dest.bitwise_or_(columns[:, k])
        return out

    def decode(self, data: Payload, numel: int) -> torch.Tensor:
        raw, _ = self._as_uint8(data, numel)
        if numel == 0:
            return torch.zeros(0, dtype=torch.float32, device="cpu")
        nblocks = self._num_blocks(numel)
        scale = raw[: nblocks * 2].view(torch.bfloat16).to(torch.float32)
        _refuse_non_finite(scale * self.top, f"{self.name} payload scale")
        body = raw[nblocks * 2 :]
        out = torch.empty(nblocks * self.block_size, dtype=torch.float32, device="cpu")
        if self.bits == 8:
            out.copy_(body.view(torch.int8))
        else:
            per_byte, mask = 8 // self.bits, (1 << self.bits) - 1
            columns = out.view(-1, per_byte)
            level = _scratch.levels(min(body.numel(), self.chunk_values))
            for lo in range(0, body.numel(), level.numel()):
                packed = body[lo : lo + level.numel()]
                part = level[: packed.numel()]
                for k in range(per_byte):
                    torch.bitwise_right_shift(packed, self.bits * k, out=part)
                    columns[lo : lo + packed.numel(), k].copy_(part.bitwise_and_(mask))
            out.sub_(self.offset)
        out.view(nblocks, self.block_size).mul_(scale[:, None])
        return out[:numel] if out.numel() != numel else out

    def __repr__(self) -> str:
        return f"BlockQuantCodec(bits={self.bits}, block_size={self.block_size})"


DEFAULT_DENSITY = 1 / 64
"""The ``sparse`` codec's density when none is given: 64 of every 4096 values."""


def get_codec(name: str, block_size: int = 64, density: float = DEFAULT_DENSITY) -> Codec:
    """The codec called ``name`` (one of fp32, bf16, int8, int4, int2, sparse); ``block_size``
    is the block codecs' values per scale, ``density`` the sparse codec's share of values sent."""
    if name == EXACT:
        return FloatCodec(EXACT, torch.float32)
    if name == "bf16":
        return FloatCodec("bf16", torch.bfloat16)
    if name == "int8":
        return BlockQuantCodec(8, block_size)
    if name in ("int4", "int2"):
        return BlockQuantCodec(int(name[3:]), block_size)
    if name == "sparse":
        from lightning_diloco.core.sparse_codec import SparseCodec  # it builds on this module

        return SparseCodec(density)
    raise ValueError(f"unknown codec {name!r}; use one of fp32, bf16, int8, int4, int2, sparse")
