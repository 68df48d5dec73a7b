"""Chunked streaming of byte payloads: no message ever nears gRPC's size limits."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 4 * CHUNK_BYTES  # receive limit on both ends: a chunk plus its header


def iter_chunks(header: Any, payload: torch.Tensor, make: Any, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Any]:
    """Messages ``make(header=..., data=...)``: the header rides on the first one only."""
    flat = payload.reshape(-1).view(torch.uint8) if payload.numel() else payload
    view = flat.numpy() if flat.numel() else b""
    if len(view) == 0:
        yield make(header=header, data=b"")
        return
    for start in range(0, len(view), chunk_bytes):
        yield make(header=header if start == 0 else None, data=view[start : start + chunk_bytes].tobytes())


def assemble(first_data: bytes, rest: Iterable[Any], expected: int, what: str) -> bytearray:
    """Join a header chunk's data and the following chunks into exactly ``expected`` bytes.

    Raises ValueError when the stream carries more or fewer bytes than its header declared, so an
    oversized stream is cut off as soon as it overflows instead of being buffered whole. The
    buffer grows with the bytes that arrive: a header alone costs nothing, whatever it declares.
    """
    buffer = bytearray()
    for data in _datas(first_data, rest):
        if len(buffer) + len(data) > expected:
            raise ValueError(f"{what} carries more than the {expected} bytes its header declared")
        buffer += data
    if len(buffer) != expected:
        raise ValueError(f"{what} ended after {len(buffer)} of the {expected} bytes its header declared")
    return buffer


def _datas(first_data: bytes, rest: Iterable[Any]) -> Iterator[bytes]:
    yield first_data
    for message in rest:
        yield message.data
