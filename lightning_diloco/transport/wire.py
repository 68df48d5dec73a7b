"""The chunked messages written and read by hand: the same bytes on the wire as the .proto's
``PushChunk``, ``FragmentChunk`` and ``SyncEvent``, with one copy of the payload where protobuf
makes three or four.

Why (benchmarks/RESULTS.md): through protobuf, every chunk of a payload was copied out of
its tensor (``tobytes``), into a message, into the serialized string, and on the receiving side out
of the received string into a message, out of the message into ``bytes`` and into a growing
buffer; and a synchronizer serialized every new version once per subscribed island. Here a chunk
is serialized straight from the tensor's memory (:func:`chunk_messages`), a received chunk's data
is a view of the received bytes (:func:`chunk_reader`, :func:`read_event`), and
:class:`DownlinkMessages` serializes each version once for every island that gets it.

Any valid encoding of the messages is read (fields in any order, repeated, unknown fields skipped),
so a client built from the .proto alone talks to these functions and the other way round;
tests/transport/test_wire.py checks both directions against protobuf.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError, Message

from lightning_diloco.core.codecs import Payload, payload_size
from lightning_diloco.core.protocol import VersionUpdate
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport import synchronizer_pb2_grpc as pb_grpc
from lightning_diloco.transport.chunks import CHUNK_BYTES
from lightning_diloco.transport.messages import to_header

_LEN = 2  # the wire type of bytes and embedded messages
_SKIP = {0: None, 1: 8, 5: 4}  # wire type -> bytes to skip (None: a varint)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field: int, length: int) -> bytes:
    """The tag and length that open a length-delimited field."""
    return _varint(field << 3 | _LEN) + _varint(length)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview) -> dict[int, list[memoryview]]:
    """The length-delimited fields of one message, each number's occurrences in order."""
    fields: dict[int, list[memoryview]] = {}
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        number, kind = tag >> 3, tag & 7
        if kind == _LEN:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise DecodeError("a field runs past the end of its message")
            fields.setdefault(number, []).append(buf[pos : pos + length])
            pos += length
        elif kind in _SKIP:
            skip = _SKIP[kind]
            if skip is None:
                _, pos = _read_varint(buf, pos)
            else:
                pos += skip
        else:
            raise DecodeError(f"wire type {kind} (a group) is not used by this protocol")
        if number == 0:
            raise DecodeError("field number 0")
    if pos != len(buf):
        raise DecodeError("a field runs past the end of its message")
    return fields


def _message(parts: list[memoryview] | None, cls: type[Message]) -> Message | None:
    # several occurrences of an embedded message merge, as parsing their concatenation does
    return None if parts is None else cls.FromString(b"".join(parts))


@dataclass(frozen=True, slots=True)
class Chunk:
    """One received chunk: its header (first chunk only, else None) and a view of its data."""

    header: Any
    data: memoryview
    size: int
    """Bytes of the whole message on the wire."""


NO_CHUNK = Chunk(header=None, data=memoryview(b""), size=0)  # what an event without a chunk field reads as


@dataclass(frozen=True, slots=True)
class Event:
    """One received subscription event: a round request or a chunk of a version."""

    request: pb.RoundRequest | None
    chunk: Chunk | None
    size: int


def _chunk(buf: memoryview, header_type: type[Message], size: int, default_header: bool = False) -> Chunk:
    fields = _fields(buf)
    data = fields.get(2)
    header = _message(fields.get(1), header_type)
    if header is None and default_header:
        header = header_type()
    return Chunk(header=header, data=data[-1] if data else memoryview(b""), size=size)


def chunk_reader(header_type: type[Message], *, default_header: bool = False) -> Callable[[bytes], Chunk]:
    """A gRPC deserializer of ``PushChunk`` (``header_type`` PushHeader) or ``FragmentChunk``
    (FragmentHeader) messages. ``default_header``: a chunk without a header reads as protobuf
    reads it, a header of defaults (the server refuses a stream that starts so with a reason)."""
    return lambda raw: _chunk(memoryview(raw), header_type, len(raw), default_header)


def read_event(raw: bytes) -> Event:
    """A gRPC deserializer of ``SyncEvent`` messages."""
    fields = _fields(memoryview(raw))
    parts = fields.get(2)
    # a chunk field seen more than once would merge its parts: header and data as protobuf reads them
    chunk = None if parts is None else _chunk(memoryview(b"".join(parts)) if len(parts) > 1 else parts[0], pb.FragmentHeader, len(raw))
    return Event(request=_message(fields.get(1), pb.RoundRequest), chunk=chunk, size=len(raw))


def serialize(message: Message | bytes) -> bytes:
    """A gRPC serializer for messages given as protobuf objects or already serialized."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def chunk_messages(header: Message, payload: Payload, *, event: bool = False,
                   chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """``payload`` (a uint8 tensor, or bytes) as serialized chunk messages, ``header`` on the first:
    ``PushChunk`` / ``FragmentChunk``, or with ``event`` a ``SyncEvent`` carrying each chunk."""
    view = _bytes_view(payload)
    head = header.SerializeToString()
    for start in range(0, max(len(view), 1), chunk_bytes):
        data = view[start : start + chunk_bytes]
        parts: list[Any] = [_key(1, len(head)), head] if start == 0 else []
        if len(data):  # proto3 leaves an empty bytes field out
            parts += [_key(2, len(data)), data]
        if event:
            parts.insert(0, _key(2, sum(len(p) for p in parts)))
        yield b"".join(parts)


def _bytes_view(payload: Payload) -> memoryview:
    """The payload's bytes in place, uncopied."""
    if not isinstance(payload, torch.Tensor):
        return memoryview(payload).cast("B")
    return memoryview(payload.reshape(-1).view(torch.uint8).numpy()) if payload.numel() else memoryview(b"")  # type: ignore[arg-type]  # a buffer; numpy says so for Python 3.12+ only


def assemble(first: Chunk, rest: Iterator[Chunk], expected: int, what: str) -> memoryview:
    """Join a stream's chunks into exactly ``expected`` bytes: a writable view that the codecs may
    decode in place (core/codecs.py).

    Raises ValueError when the stream carries more or fewer bytes than its header declared, as
    soon as it overflows. The buffer is reserved, not written: memory is taken as bytes arrive,
    so a header alone costs nothing, whatever it declares.
    """
    buffer = memoryview(np.empty(expected, dtype=np.uint8)).cast("B")  # type: ignore[arg-type]  # a buffer; numpy says so for Python 3.12+ only
    filled = 0
    for chunk in _chain(first, rest):
        end = filled + len(chunk.data)
        if end > expected:
            raise ValueError(f"{what} carries more than the {expected} bytes its header declared")
        buffer[filled:end] = chunk.data
        filled = end
    if filled != expected:
        raise ValueError(f"{what} ended after {filled} of the {expected} bytes its header declared")
    return buffer


def _chain(first: Chunk, rest: Iterator[Chunk]) -> Iterator[Chunk]:
    yield first
    yield from rest


class DownlinkMessages:
    """Each version's subscription messages, serialized once and sent to every island that gets
    the same version as the same delta (fragment, version, base, round, included, codec); a fragment's older versions are dropped as a
    newer one is built."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[tuple, _Built] = {}

    def messages(self, update: VersionUpdate) -> tuple[bytes, ...]:
        key = (update.fragment, update.version, update.base_version, update.round, update.included, update.codec)
        with self.lock:
            built = self.entries.get(key)
            builder = built is None
            if built is None:
                built = self.entries[key] = _Built()
                for old in [k for k in self.entries if k[0] == update.fragment and k[1] < update.version]:
                    del self.entries[old]
        if not builder:
            built.ready.wait()
            if built.messages is not None:
                return built.messages
        messages = None
        try:
            header = to_header(update, pb.FragmentHeader(), payload_bytes=payload_size(update.payload))
            messages = tuple(chunk_messages(header, update.payload, event=True))
        finally:
            if builder:  # on failure the waiting islands build their own
                built.messages = messages
                if messages is None:
                    with self.lock:
                        self.entries.pop(key, None)
                built.ready.set()
        return messages


class _Built:
    def __init__(self) -> None:
        self.ready = threading.Event()
        self.messages: tuple[bytes, ...] | None = None


# what each chunked method reads and writes instead of protobuf objects (the others keep protobuf's)
_SERVER_WIRE: dict[str, dict[str, Any]] = {
    "Seed": {"request_deserializer": chunk_reader(pb.FragmentHeader, default_header=True)},
    "Push": {"request_deserializer": chunk_reader(pb.PushHeader, default_header=True)},
    "Subscribe": {"response_serializer": serialize},
    "Pull": {"response_serializer": serialize},
    "ExportFragment": {"response_serializer": serialize},
}


def add_servicer(servicer: pb_grpc.SynchronizerServicer, server: grpc.Server) -> None:
    """``pb_grpc.add_SynchronizerServicer_to_server`` with the chunked methods read and written
    here: the generated table, taken from the generated function, with their (de)serializers swapped."""
    table = _GeneratedTable()
    pb_grpc.add_SynchronizerServicer_to_server(servicer, table)
    handlers = {name: handler._replace(**_SERVER_WIRE.get(name, {})) for name, handler in table.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(table.service, handlers),))
    server.add_registered_method_handlers(table.service, handlers)


class _GeneratedTable:
    """Stands in for a server to catch the generated method table."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def stub(channel: grpc.Channel) -> pb_grpc.SynchronizerStub:
    """The generated stub, its chunked methods sending serialized messages (protobuf objects
    too) and reading :class:`Chunk` and :class:`Event` objects."""
    methods = pb_grpc.SynchronizerStub(channel)
    path = "/lightning_diloco.v1.Synchronizer/"
    methods.Seed = channel.stream_unary(path + "Seed", request_serializer=serialize,
                                        response_deserializer=pb.SeedReply.FromString, _registered_method=True)
    methods.Push = channel.stream_unary(path + "Push", request_serializer=serialize,
                                        response_deserializer=pb.PushAck.FromString, _registered_method=True)
    methods.Subscribe = channel.unary_stream(path + "Subscribe", request_serializer=pb.SubscribeRequest.SerializeToString,
                                             response_deserializer=read_event, _registered_method=True)
    methods.Pull = channel.unary_stream(path + "Pull", request_serializer=pb.PullRequest.SerializeToString,
                                        response_deserializer=chunk_reader(pb.FragmentHeader), _registered_method=True)
    methods.ExportFragment = channel.unary_stream(
        path + "ExportFragment", request_serializer=pb.ExportFragmentRequest.SerializeToString,
        response_deserializer=chunk_reader(pb.FragmentHeader), _registered_method=True)
    return methods
