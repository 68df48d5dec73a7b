"""The gRPC transport of an island's link (transport/shard_transport.py): one channel per shard,
each call a message (or a header and chunks, wire.py) and its answer, a gRPC failure turned into
a refusal (its details start with the reason), an unanswered call or a passed deadline.

It counts the bytes it sends and receives, and carries the credential on every call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from lightning_diloco.core.codecs import EXACT, Payload, get_codec, payload_size
from lightning_diloco.core.protocol import Beat, Contribution, PushAck, RoundRequest, SynchronizerStatus, VersionUpdate
from lightning_diloco.reasons import Reason
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport.chunks import MAX_MESSAGE_BYTES
from lightning_diloco.transport.messages import from_header, from_message, join_info, to_header
from lightning_diloco.transport.shard_transport import JoinRequest, Refused, ShardJoin, Unanswered
from lightning_diloco.transport.tls_hint import tls_mismatch_hint
from lightning_diloco.transport.wire import NO_CHUNK, Chunk, assemble, chunk_messages, stub

T = TypeVar("T")

# a synchronizer that is away, not refusing: a call is retried, a join goes on without the shard
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# how a subscription's stream ends when nothing refused it: reopened without a word
STREAM_ENDED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)

LEAVE_TIMEOUT = 2.0
"""Seconds a Leave may take per shard: it is sent as the island stops, which must not wait for a
synchronizer that is gone."""

READY_PROBE = "/lightning_diloco.transport.ReadyProbe/Wait"
"""A method no server has. Called with ``wait_for_ready``, gRPC holds it until the channel is
connected, and the server's gRPC answers it UNIMPLEMENTED at once, before any handler or log."""


def failure(err: grpc.RpcError, away: tuple = RETRYABLE) -> Exception:
    """The transport's exception for a failed gRPC call: ``Unanswered`` for the codes in ``away``."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(details or "deadline exceeded")
    if code in away:
        return Unanswered(code, code.name, details)
    return Refused(code, Reason.parse(details), code.name, details)


class GrpcShards:
    """The shards at ``addresses`` over gRPC. ``timeout``: seconds per call; ``token``: the
    credential every call carries; ``tls_root_cert``: TLS, trusting that root."""

    def __init__(self, addresses: Sequence[str], *, token: str | None = None, tls_root_cert: str | Path | None = None,
                 timeout: float = 30.0) -> None:
        self.addresses = list(addresses)
        self.description = f"the client of the synchronizer at {','.join(self.addresses)}"
        self.timeout = timeout
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        root = Path(tls_root_cert).read_bytes() if tls_root_cert else None
        self.uses_tls = root is not None
        self.channels = [
            grpc.secure_channel(a, grpc.ssl_channel_credentials(root), options) if root else grpc.insecure_channel(a, options)
            for a in self.addresses
        ]
        self.stubs = [stub(c) for c in self.channels]
        self._lock = threading.Lock()
        self.bytes_sent = self.bytes_received = 0

    def count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    def grpc_call(self, call):
        """``call()``'s answer, a gRPC failure raised as the transport's."""
        try:
            return call()
        except grpc.RpcError as err:
            raise failure(err) from None

    # ---- the calls ------------------------------------------------------------------------------

    def join(self, shard: int, request: JoinRequest, previous_session: str) -> ShardJoin:
        message = pb.JoinRequest(
            island=request.island, world_size=request.world_size, num_islands=request.num_islands,
            tensors=[pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, role=s.role) for s in request.specs],
            previous_session=previous_session,
        )
        reply = self.grpc_call(lambda: self.stubs[shard].Join(message, timeout=self.timeout, metadata=self.metadata))
        self.count(message.ByteSize(), reply.ByteSize())
        return ShardJoin(info=join_info(reply), shard=reply.shard, num_shards=reply.num_shards)

    def seed(self, shard: int, island: int, fragment: int, payload: Payload, session: str) -> tuple[bool, int]:
        header = pb.FragmentHeader(fragment=fragment, island=island, codec=EXACT, payload_bytes=payload_size(payload),
                                   session=session)
        reply = self.grpc_call(lambda: self.stubs[shard].Seed(self._counted(chunk_messages(header, payload)),
                                                              timeout=self.timeout, metadata=self.metadata))
        return reply.seeded, reply.version

    def push(self, shard: int, contribution: Contribution) -> PushAck:
        header = to_header(contribution, pb.PushHeader(), payload_bytes=payload_size(contribution.payload))
        ack = self.grpc_call(lambda: self.stubs[shard].Push(self._counted(chunk_messages(header, contribution.payload)),
                                                            timeout=self.timeout, metadata=self.metadata))
        self.count(received=ack.ByteSize())
        return from_message(ack, PushAck)

    def pull(self, shard: int, island: int, fragment: int, session: str) -> tuple[int, torch.Tensor]:
        request = pb.PullRequest(fragment=fragment, island=island, session=session)

        def call():
            replies = self.stubs[shard].Pull(request, timeout=self.timeout, metadata=self.metadata)
            return self.receive(replies, f"pull of fragment {fragment}")

        header, data = self.grpc_call(call)
        return header.version, get_codec(EXACT).decode(data, len(data) // 4)

    def heartbeat(self, shard: int, island: int, steps: int, step_time: float, schedule_step: int, session: str) -> Beat:
        request = pb.HeartbeatRequest(island=island, steps=steps, step_time=step_time, schedule_step=schedule_step,
                                      session=session)
        self.count(sent=request.ByteSize())
        reply = self.grpc_call(lambda: self.stubs[shard].Heartbeat(request, timeout=self.timeout, metadata=self.metadata))
        self.count(received=reply.ByteSize())
        return from_message(reply, Beat)

    def leave(self, shard: int, island: int, session: str) -> None:
        request = pb.LeaveRequest(island=island, session=session)
        self.grpc_call(lambda: self.stubs[shard].Leave(request, timeout=LEAVE_TIMEOUT, metadata=self.metadata))

    def status(self, shard: int) -> SynchronizerStatus:
        reply = self.grpc_call(lambda: self.stubs[shard].Status(pb.StatusRequest(), timeout=self.timeout,
                                                                metadata=self.metadata))
        return from_message(reply, SynchronizerStatus)

    def events(self, shard: int, island: int, versions: dict[int, int], session: str) -> _Events:
        request = pb.SubscribeRequest(island=island, versions=versions, session=session)
        return _Events(self.stubs[shard].Subscribe(request, metadata=self.metadata), self)

    # ---- waiting, closing ---------------------------------------------------------------------

    def wait_ready(self, shard: int | None, delay: float, closed: threading.Event) -> None:
        """Wait ``delay`` seconds or until the shard's channel (every channel: None) is connected.

        It waits with a call (:data:`READY_PROBE`) on this thread, not with
        ``grpc.channel_ready_future``: that subscribes to the channel's connectivity, which gRPC
        polls on a thread of its own for up to 0.2 s after the last wait ended, and a close in
        that time made that thread raise "Cannot invoke RPC: Channel closed!" and print its
        traceback (gRPC's ``_poll_connectivity`` does not expect a closed channel). A call in
        flight is simply ended by the close (CANCELLED), like any other.
        """
        started = time.monotonic()
        for channel in self.channels if shard is None else [self.channels[shard]]:
            left = started + delay - time.monotonic()
            if left <= 0 or closed.is_set():
                return
            try:
                channel.unary_unary(READY_PROBE)(b"", timeout=left, wait_for_ready=True)
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                    return  # not connected within the delay, or close() ended the wait
                # any answer (UNIMPLEMENTED: no server has that method) means the channel is connected
            except ValueError:  # the channel was closed under us (shutdown): the next attempt reports it
                return
        # a connected channel can still answer UNAVAILABLE (a server shutting down): do not spin
        closed.wait(max(0.0, started + min(delay, 0.5) - time.monotonic()))

    def hint(self, shard: int, details: str) -> str:
        return tls_mismatch_hint(self.addresses[shard], self.uses_tls, details)

    def close(self) -> None:
        for channel in self.channels:  # ends the calls in flight, a wait for a channel included
            channel.close()

    # ---- streaming helpers ----------------------------------------------------------------------

    def _counted(self, messages: Iterator[bytes]) -> Iterator[bytes]:
        for message in messages:
            self.count(sent=len(message))
            yield message

    def receive(self, replies: Iterator[Chunk], what: str) -> tuple[pb.FragmentHeader, memoryview]:
        """A chunked reply's header and its payload, whole."""
        first = next(replies)
        self.count(received=first.size)
        header = first.header or pb.FragmentHeader()
        data = assemble(first, self._counted_in(replies), header.payload_bytes, what)
        return header, data

    def _counted_in(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        for chunk in chunks:
            self.count(received=chunk.size)
            yield chunk


class _Events:
    """A Subscribe call's events (wire.py's) as round requests and whole version updates."""

    def __init__(self, call: Any, shards: GrpcShards) -> None:
        self.call, self.shards = call, shards

    def cancel(self) -> Any:
        return self.call.cancel()

    def __iter__(self) -> Iterator[RoundRequest | VersionUpdate]:
        try:
            yield from self._records()
        except grpc.RpcError as err:
            raise failure(err, away=STREAM_ENDED) from None

    def _records(self) -> Iterator[RoundRequest | VersionUpdate]:
        header, buffer, filled = None, bytearray(), 0
        for event in self.call:  # a chunk's data is a view of the received bytes
            self.shards.count(received=event.size)
            if event.request is not None:
                yield from_message(event.request, RoundRequest)
                continue
            chunk = event.chunk or NO_CHUNK
            if chunk.header is not None:
                header, buffer, filled = chunk.header, bytearray(chunk.header.payload_bytes), 0
            if header is None:
                raise ValueError("a version chunk arrived without its header")
            end = filled + len(chunk.data)
            if end > len(buffer):
                raise ValueError(f"version {header.version} of fragment {header.fragment} carries more bytes than declared")
            buffer[filled:end] = chunk.data
            filled = end
            if filled == len(buffer):
                yield from_header(header, VersionUpdate, buffer)
                header, buffer = None, bytearray()
