"""The hand-written chunk messages are protobuf's bytes, and read whatever protobuf writes."""

from __future__ import annotations

import pytest
import torch
from google.protobuf.message import DecodeError

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import VersionUpdate
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport.wire import DownlinkMessages, assemble, chunk_messages, chunk_reader, read_event

HEADER = pb.PushHeader(island=3, fragment=1, round=7, base_version=2, tokens=12.5, steps=4, codec="bf16", seq=9,
                       layout_hash="abc", payload_bytes=10, session="s")


def _protobuf_chunks(header, payload: bytes, chunk_bytes: int, make):
    """What the protocol's messages are, built with protobuf (the header on the first chunk)."""
    starts = range(0, max(len(payload), 1), chunk_bytes)
    return [make(header=header if start == 0 else None, data=payload[start : start + chunk_bytes]).SerializeToString()
            for start in starts]


@pytest.mark.parametrize("size", [0, 1, 4, 5, 9])
def test_chunks_are_the_bytes_protobuf_writes(size):
    payload = torch.arange(size, dtype=torch.uint8)
    raw = bytes(payload.numpy())
    assert list(chunk_messages(HEADER, payload, chunk_bytes=4)) == _protobuf_chunks(HEADER, raw, 4, pb.PushChunk)
    fragment_header = pb.FragmentHeader(fragment=1, version=5, base_version=4, codec="bf16", payload_bytes=size, included=True)
    as_events = _protobuf_chunks(fragment_header, raw, 4, lambda **kw: pb.SyncEvent(chunk=pb.FragmentChunk(**kw)))
    assert list(chunk_messages(fragment_header, payload, event=True, chunk_bytes=4)) == as_events


def test_read_chunks_match_protobufs_reading_of_any_valid_encoding():
    read = chunk_reader(pb.PushHeader)
    plain = pb.PushChunk(header=HEADER, data=b"payload").SerializeToString()
    chunk = read(plain)
    assert chunk.header == HEADER and bytes(chunk.data) == b"payload" and chunk.size == len(plain)
    no_header = read(pb.PushChunk(data=b"xy").SerializeToString())
    assert no_header.header is None and bytes(no_header.data) == b"xy"
    # data before header, data twice (the last counts), the header split in two (they merge), and
    # unknown fields of every wire type: protobuf reads these, and so must the server
    half = pb.PushHeader(island=3).SerializeToString(), pb.PushHeader(seq=9).SerializeToString()
    odd = (b"\x12\x01a" + b"\x0a" + bytes([len(half[0])]) + half[0] + b"\x12\x02bc" + b"\x0a" + bytes([len(half[1])]) + half[1]
           + b"\x18\x96\x01" + b"\x21" + b"\0" * 8 + b"\x2d" + b"\0" * 4 + b"\x3a\x01z")
    expected = pb.PushChunk.FromString(odd)
    got = read(odd)
    assert got.header == expected.header and bytes(got.data) == expected.data == b"bc"


@pytest.mark.parametrize("garbage", [b"\x12\x05ab", b"\x0a", b"\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0b"])
def test_a_malformed_chunk_is_refused(garbage):
    with pytest.raises(DecodeError):
        chunk_reader(pb.PushHeader)(garbage)


def test_events_read_requests_and_chunks():
    request = pb.SyncEvent(request=pb.RoundRequest(fragment=2, round=5, due_step=40)).SerializeToString()
    event = read_event(request)
    assert event.chunk is None and event.request == pb.RoundRequest(fragment=2, round=5, due_step=40)
    header = pb.FragmentHeader(fragment=1, version=5, payload_bytes=3)
    event = read_event(pb.SyncEvent(chunk=pb.FragmentChunk(header=header, data=b"abc")).SerializeToString())
    assert event.request is None and event.chunk.header == header and bytes(event.chunk.data) == b"abc"


def test_assemble_checks_the_declared_size_and_hands_the_codecs_a_buffer_they_may_consume():
    read = chunk_reader(pb.FragmentHeader)
    value = torch.randn(6)
    payload = get_codec("fp32").encode(value)
    first, *rest = (read(m) for m in chunk_messages(pb.FragmentHeader(payload_bytes=24), payload, chunk_bytes=10))
    data = assemble(first, iter(rest), 24, "seed")
    assert isinstance(data, memoryview) and not data.readonly
    decoded = get_codec("fp32").decode(data, 6)
    assert torch.equal(decoded, value) and decoded.data_ptr() == torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    with pytest.raises(ValueError, match="more than the 20 bytes"):
        assemble(first, iter(rest), 20, "seed")
    with pytest.raises(ValueError, match="ended after 24 of the 30 bytes"):
        assemble(first, iter(rest), 30, "seed")


def test_each_version_is_serialized_once_for_every_island_that_gets_it():
    downlink = DownlinkMessages()

    def update(version, included=False):
        return VersionUpdate(fragment=0, version=version, base_version=version - 1, round=version - 1, codec="bf16",
                             payload=torch.arange(6, dtype=torch.uint8), included=included)

    first = downlink.messages(update(1))
    assert downlink.messages(update(1)) is first  # the same bytes objects for the next island
    assert downlink.messages(update(1, included=True)) is not first  # its header differs
    event = read_event(first[0])
    assert event.chunk.header.version == 1 and bytes(event.chunk.data) == bytes(range(6))
    downlink.messages(update(2))
    assert {key[1] for key in downlink.entries} == {2}  # older versions are dropped
