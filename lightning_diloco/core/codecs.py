"""Wire encodings of a flat fp32 fragment: fp32, bf16, and int8/int4 with per-block scales.

Error bounds (per element, x the input, x' the decoded value), tested in tests/unit:

- ``fp32``: exact.
- ``bf16``: |x - x'| <= 2**-8 * |x| (round to nearest, 8 significant bits).
- ``int8``/``int4``: symmetric levels -q..q (q = 127 or 7) scaled by the block's absmax / q,
  the scale stored as bf16: |x - x'| <= (1 + 2**-8) / 2 * absmax(block) / q.

Layout of the quantized forms: ``nblocks`` bf16 scales, then the values (int8: one byte each;
int4: two per byte, low nibble first, stored as q + 8). The tail block is zero-padded. Non-finite
input is refused on encode and non-finite output on decode, so a corrupt payload cannot leak NaN
into the global model.
"""

from __future__ import annotations

import math
import warnings

import torch

# Decoding reads straight from the received bytes (no copy) and never writes to them.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class Codec:
    """Encode a 1-D fp32 tensor to bytes and back. Subclasses are stateless."""

    name: str

    def encoded_size(self, numel: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        raise NotImplementedError

    def _check_size(self, data: bytes, numel: int) -> None:
        expected = self.encoded_size(numel)
        if len(data) != expected:
            raise ValueError(
                f"{self.name} payload of {len(data)} bytes does not match {numel} values "
                f"(expected {expected} bytes); was it encoded with another codec or shape?"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _refuse_non_finite(x: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{what} has {bad} non-finite value(s) (NaN or inf); refusing to send or merge them")


class FloatCodec(Codec):
    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype = name, dtype
        self.itemsize = torch.empty(0, dtype=dtype).element_size()

    def encoded_size(self, numel: int) -> int:
        return numel * self.itemsize

    def encode(self, x: torch.Tensor) -> bytes:
        flat = x.detach().reshape(-1)
        _refuse_non_finite(flat, f"{self.name} input")
        return flat.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_size(data, numel)
        if numel == 0:
            return torch.zeros(0, dtype=torch.float32)
        raw = torch.frombuffer(data, dtype=self.dtype, count=numel)
        out = raw.to(torch.float32, copy=True)
        _refuse_non_finite(out, f"decoded {self.name} payload")
        return out

    def __repr__(self) -> str:
        return f"FloatCodec({self.name!r})"


class BlockQuantCodec(Codec):
    """Symmetric per-block quantization to ``bits`` (8 or 4) with bf16 scales."""

    def __init__(self, bits: int, block_size: int = 64) -> None:
        assert bits in (4, 8), f"{bits=}"
        assert block_size >= 2 and block_size % 2 == 0, f"{block_size=}"
        self.bits, self.block_size = bits, block_size
        self.qmax = 2 ** (bits - 1) - 1
        self.name = f"int{bits}"

    def _num_blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block_size)

    def encoded_size(self, numel: int) -> int:
        nblocks = self._num_blocks(numel)
        return nblocks * 2 + nblocks * self.block_size * self.bits // 8

    def encode(self, x: torch.Tensor) -> bytes:
        flat = x.detach().reshape(-1).to(torch.float32)
        numel = flat.numel()
        if numel == 0:
            return b""
        nblocks = self._num_blocks(numel)
        pad = nblocks * self.block_size - numel
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        blocks = flat.view(nblocks, self.block_size)
        absmax = blocks.abs().amax(dim=1)
        _refuse_non_finite(absmax, f"{self.name} input")
        scale = (absmax / self.qmax).to(torch.bfloat16)
        # Quantize against the rounded scale so the decoder's reconstruction matches exactly.
        divisor = scale.to(torch.float32)
        divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
        q = (blocks / divisor[:, None]).round_().clamp_(-self.qmax, self.qmax)

        out = torch.empty(self.encoded_size(numel), dtype=torch.uint8)
        out[: nblocks * 2].view(torch.bfloat16).copy_(scale)
        body = out[nblocks * 2 :]
        if self.bits == 8:
            body.view(torch.int8).copy_(q.view(-1))
        else:
            nibbles = q.view(-1, 2).add_(8).to(torch.uint8)
            torch.bitwise_or(nibbles[:, 0], nibbles[:, 1] << 4, out=body)
        return out.numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        self._check_size(data, numel)
        if numel == 0:
            return torch.zeros(0, dtype=torch.float32)
        nblocks = self._num_blocks(numel)
        scale = torch.frombuffer(data, dtype=torch.bfloat16, count=nblocks).to(torch.float32)
        _refuse_non_finite(scale * self.qmax, f"{self.name} payload scale")
        if self.bits == 8:
            q = torch.frombuffer(data, dtype=torch.int8, offset=nblocks * 2).to(torch.float32)
        else:
            packed = torch.frombuffer(data, dtype=torch.uint8, offset=nblocks * 2)
            q = torch.empty(packed.numel(), 2, dtype=torch.float32)
            q[:, 0] = packed & 0x0F
            q[:, 1] = packed >> 4
            q = q.view(-1).sub_(8)
        out = q.view(nblocks, self.block_size).mul_(scale[:, None]).view(-1)
        return out[:numel] if out.numel() != numel else out

    def __repr__(self) -> str:
        return f"BlockQuantCodec(bits={self.bits}, block_size={self.block_size})"


def get_codec(name: str, block_size: int = 64) -> Codec:
    """The codec called ``name`` (one of fp32, bf16, int8, int4)."""
    if name == "fp32":
        return FloatCodec("fp32", torch.float32)
    if name == "bf16":
        return FloatCodec("bf16", torch.bfloat16)
    if name == "int8":
        return BlockQuantCodec(8, block_size)
    if name == "int4":
        return BlockQuantCodec(4, block_size)
    raise ValueError(f"unknown codec {name!r}; use one of fp32, bf16, int8, int4")
