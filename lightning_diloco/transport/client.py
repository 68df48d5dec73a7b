"""The learner's side of the wire: routing by fragment, deadlines, retries, byte counters.

A synchronizer that is briefly away (restarting, unreachable) is retried with exponential
backoff and jitter; after a restart the client joins again by itself. A refusal is not retried:
it surfaces as :class:`SynchronizerError` carrying the synchronizer's reason.

A sharded run goes on without a dead shard: a join succeeds when at least one shard answers, the
shards that did not (or that stopped answering later) are *absent*, and calls for their fragments
fail at once instead of waiting out the retries, until the shard's subscription reader finds it
back and joins it (subscription.py). Its fragments train locally meanwhile. The sessions with the
shards (joining, joining again, absence) are a :class:`~lightning_diloco.transport.sessions.ShardSessions`
the client holds.

New global versions and the synchronizer's requests arrive through a subscription
(subscription.py): one long-lived stream per shard, read on its own thread, reopened whenever it
breaks.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
import torch

from lightning_diloco.core.codecs import EXACT, get_codec, payload_size
from lightning_diloco.core.fragments import FragmentLayout, TensorSpec
from lightning_diloco.core.global_model import ShardModel
from lightning_diloco.core.protocol import (
    RUNNING_PATIENCE,
    Beat,
    Contribution,
    JoinInfo,
    PushAck,
    RoundRequest,
    SynchronizerStatus,
    VersionUpdate,
)
from lightning_diloco.core.state import shard_of
from lightning_diloco.reasons import REJOIN, Reason, SynchronizerError
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport import synchronizer_pb2_grpc as pb_grpc
from lightning_diloco.transport.chunks import MAX_MESSAGE_BYTES
from lightning_diloco.transport.messages import from_message, to_header
from lightning_diloco.transport.sessions import RETRYABLE, ShardSessions
from lightning_diloco.transport.subscription import Subscription
from lightning_diloco.transport.tls_hint import tls_mismatch_hint
from lightning_diloco.transport.wire import Chunk, assemble, chunk_messages, stub

log = logging.getLogger(__name__)
T = TypeVar("T")

LEAVE_TIMEOUT = 2.0
"""Seconds a Leave may take per shard: it is sent as the island stops, which must not wait for a
synchronizer that is gone."""

READY_PROBE = "/lightning_diloco.transport.ReadyProbe/Wait"
"""A method no server has. Called with ``wait_for_ready``, gRPC holds it until the channel is
connected, and the server's gRPC answers it UNIMPLEMENTED at once, before any handler or log."""


def parse_addresses(addresses: str | Sequence[str]) -> list[str]:
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    out = [a.strip() for a in items if a.strip()]
    if not out:
        raise ValueError("no synchronizer address given; pass host:port (comma-separated for shards)")
    for address in out:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"synchronizer address {address!r} needs a port: host:port, e.g. {address.rstrip(':')}:7470")
    return out


class SynchronizerClient:
    running_patience = RUNNING_PATIENCE
    """Seconds a join refused as ``island_running`` is retried (core/protocol.py)."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        token: str | None = None,
        tls_root_cert: str | Path | None = None,
        timeout: float = 30.0,
        max_retries: int = 8,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
        rng: random.Random | None = None,
    ) -> None:
        """``timeout``: seconds per call (pushes add the round wait given to :meth:`push`).
        ``max_retries``: attempts after the first on an unreachable synchronizer, with delays
        ``backoff * 2**k`` capped at ``max_backoff``, each jittered by up to 50%."""
        self.addresses = parse_addresses(addresses)
        self.timeout, self.max_retries = timeout, max_retries
        self.backoff, self.max_backoff = backoff, max_backoff
        self.rng = rng or random.Random()
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
        self.shard_sessions = ShardSessions(self.stubs, self.addresses, timeout=timeout, metadata=self.metadata,
                                            count=self._count)
        self.bytes_sent = self.bytes_received = 0
        self._subscriptions: list[Subscription] = []  # kept after close: every close joins them
        self._closed = threading.Event()

    @property
    def num_shards(self) -> int:
        return len(self.stubs)

    @property
    def sessions(self) -> list[str]:
        """This island's session with each shard ("": absent, not joined or stopped answering)."""
        return list(self.shard_sessions.sessions)

    def shard_of(self, fragment: int) -> int:
        return shard_of(fragment, self.num_shards)

    def _stub(self, fragment: int) -> pb_grpc.SynchronizerStub:
        return self.stubs[self.shard_of(fragment)]

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received

    # ---- retries ------------------------------------------------------------------------------

    def _call(self, what: str, call: Callable[[], T], shard: int | None = None, patience: float = 0.0) -> T:
        """Run ``call``, retrying while the synchronizer is unreachable.

        Between attempts it waits for the backoff delay or until the shard's channel reconnects,
        whichever comes first (but at least half a second, or the delay if shorter, so a server
        that answers UNAVAILABLE on a ready channel is not hammered): a synchronizer that is back
        is used at once, not after the full backoff.
        ``patience``: seconds during which it keeps retrying even after ``max_retries``.
        """
        attempt = 0
        keep_trying_until = time.monotonic() + patience
        while True:
            self._check_open(what)
            if shard is not None and self.shard_sessions.request is None:  # absent too, but nothing was asked
                raise SynchronizerError(None, Reason.NOT_JOINED, f"{what}: this client has not joined the run (or "
                                        "left it); call join first")
            if shard is not None and self.shard_sessions.absent(shard):
                raise SynchronizerError(grpc.StatusCode.UNAVAILABLE, Reason.UNREACHABLE,
                                        f"{what}: shard {shard} at {self.addresses[shard]} is not answering; this island "
                                        "trains its fragments locally and joins the shard again once it is back")
            joins = self.shard_sessions.joins[shard] if shard is not None else 0
            try:
                return call()
            except ValueError:  # gRPC's "Cannot invoke RPC on closed channel!": closed under the call
                self._check_open(what)
                raise
            except grpc.RpcError as err:
                self._check_open(what)  # close() ends the calls in flight (CANCELLED): say why
                code, details = err.code(), err.details() or ""
                reason = Reason.parse(details)
                if reason in REJOIN and self.shard_sessions.request and shard is not None:
                    log.info("%s: %s (the synchronizer restarted, or this island joined again elsewhere); joining again",
                             what, reason)
                    try:
                        self.shard_sessions.rejoin(shard, joins)
                    except ValueError:  # the client closed under the join (closed channel)
                        self._check_open(what)
                        raise
                    except grpc.RpcError as join_err:  # a synchronizer still starting: retried like the call
                        self._check_open(what)  # or the close cancelled it
                        code, details = join_err.code(), join_err.details() or ""
                        if code not in RETRYABLE:
                            raise SynchronizerError(code, Reason.parse(details), f"{what}: joining again refused "
                                                    f"({code.name}): {details}") from None
                elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise TimeoutError(f"{what}: {details or 'deadline exceeded'}") from None
                elif code not in RETRYABLE:
                    raise SynchronizerError(code, reason, f"{what} refused ({code.name}): {details}") from None
                if attempt >= self.max_retries:
                    left = keep_trying_until - time.monotonic()
                    if left <= 0:
                        if shard is not None and self.shard_sessions.request is not None:
                            self.shard_sessions.mark_absent(shard, joins)
                        hint = tls_mismatch_hint(self.addresses[shard or 0], self.uses_tls, details)
                        raise SynchronizerError(code, Reason.UNREACHABLE,
                                                f"{what}: gave up after {attempt + 1} attempts: {details}{hint}") from None
                    if attempt == self.max_retries:  # say once why the caller is waiting
                        log.warning("%s: no synchronizer reachable at %s yet; trying for %.0f s more", what, ",".join(self.addresses), left)
                delay = min(self.max_backoff, self.backoff * 2 ** min(attempt, 30)) * (0.5 + self.rng.random() / 2)
                log.debug("%s failed (%s); retrying within %.2fs", what, code.name, delay)
                self._wait_ready(shard, delay)
                attempt += 1

    def _wait_ready(self, shard: int | None, delay: float) -> None:
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
            if left <= 0 or self._closed.is_set():
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
        self._closed.wait(max(0.0, started + min(delay, 0.5) - time.monotonic()))

    # ---- calls --------------------------------------------------------------------------------

    def join(self, island: int, world_size: int, specs: Sequence[TensorSpec], patience: float = 0.0,
             num_islands: int = 0) -> JoinInfo:
        """Join every shard that answers (at least one). ``patience``: seconds to keep waiting
        for a synchronizer that is not reachable yet (an island may start before it, or while it
        restarts). ``num_islands``: the run's island count this island was started with (0: not
        said); a run of another count refuses it.

        A join refused because the island is still running elsewhere is retried for
        :attr:`running_patience` seconds: an island restarted after a crash gets in once its old
        process has fallen silent; a second process beside a live one is refused after that."""
        request = pb.JoinRequest(
            island=island,
            world_size=world_size,
            tensors=[pb.TensorSpec(name=s.name, shape=list(s.shape), dtype=s.dtype, role=s.role) for s in specs],
            num_islands=num_islands,
        )
        return self._until_not_running(island, lambda: self._call("join", lambda: self.shard_sessions.join(request),
                                                                 patience=patience))

    def _until_not_running(self, island: int, join: Callable[[], T]) -> T:
        give_up = time.monotonic() + self.running_patience
        attempt = 0
        while True:
            try:
                return join()
            except SynchronizerError as err:
                if err.reason != Reason.ISLAND_RUNNING or time.monotonic() >= give_up:
                    raise
                if attempt == 0:  # a restart after a crash waits here: say why, once
                    log.warning("%s; retrying for up to %.0f s, until island %d's old process has fallen silent", err,
                                self.running_patience, island)
            # at most a second apart: the old process's silence is what it waits for, not a server's recovery
            delay = min(1.0, self.backoff * 2 ** min(attempt, 30)) * (0.5 + self.rng.random() / 2)
            self._closed.wait(max(0.0, min(delay, give_up - time.monotonic())))
            attempt += 1

    def seed(self, island: int, fragment: int, value: torch.Tensor) -> tuple[bool, int]:
        payload = get_codec(EXACT).encode(value)

        def call():
            header = pb.FragmentHeader(fragment=fragment, island=island, codec=EXACT, payload_bytes=payload.numel(),
                                       session=self.shard_sessions.sessions[self.shard_of(fragment)])
            reply = self._stub(fragment).Seed(self._counted(chunk_messages(header, payload)), timeout=self.timeout, metadata=self.metadata)
            return reply.seeded, reply.version

        return self._call(f"seed of fragment {fragment}", call, self.shard_of(fragment))

    def push(self, contribution: Contribution) -> PushAck:
        """Send one contribution, sent for its round, with this island's session with the
        fragment's shard; answered once it is in a round.

        Safe to call again with the same ``seq``: the synchronizer never merges it twice.
        """
        fragment = contribution.fragment

        def call():
            header = to_header(contribution, pb.PushHeader(), payload_bytes=payload_size(contribution.payload))
            header.session = self.shard_sessions.sessions[self.shard_of(fragment)]  # at each attempt: a rejoin brings a new one
            ack = self._stub(fragment).Push(
                self._counted(chunk_messages(header, contribution.payload)), timeout=self.timeout, metadata=self.metadata
            )
            self._count(received=ack.ByteSize())
            return from_message(ack, PushAck)

        return self._call(f"push of fragment {fragment}", call, self.shard_of(fragment))

    def pull(self, fragment: int) -> tuple[int, torch.Tensor]:
        """(version, fp32 value) of a fragment: what a joining island starts from. A joined
        island's call: it carries the island and its session with the fragment's shard."""
        what = f"pull of fragment {fragment}"
        self._check_open(what)
        joined = self.shard_sessions.request
        if joined is None:
            raise SynchronizerError(None, Reason.NOT_JOINED, f"{what}: this client has not joined the run; call join first "
                                    "(the synchronizer answers pulls of joined islands only)")

        def call():  # built at each attempt: a rejoin between attempts brings a new session
            request = pb.PullRequest(fragment=fragment, island=joined.island,
                                     session=self.shard_sessions.sessions[self.shard_of(fragment)])
            replies = self._stub(fragment).Pull(request, timeout=self.timeout, metadata=self.metadata)
            h, data = self._receive(replies, what)
            return h.version, get_codec(EXACT).decode(data, len(data) // 4)

        return self._call(what, call, self.shard_of(fragment))

    def heartbeat(self, island: int, steps: int, step_time: float, schedule_step: int = 0) -> Beat:
        """Report progress to every joined shard; the versions of the fragments they hold (an
        absent shard's are missing) and the run's furthest clock. Raises when no shard answers."""
        versions: dict[int, int] = {}
        run_step, answered, error = 0, 0, None
        for shard, stub in enumerate(self.stubs):  # noqa: F402 - the shard's stub; the module's stub() is not used here
            def call(shard=shard, stub=stub):
                request = pb.HeartbeatRequest(island=island, steps=steps, step_time=step_time, schedule_step=schedule_step,
                                              session=self.shard_sessions.sessions[shard])
                self._count(sent=request.ByteSize())
                return stub.Heartbeat(request, timeout=self.timeout, metadata=self.metadata)

            try:
                reply = self._call(f"heartbeat to shard {shard}", call, shard)
            except SynchronizerError as err:
                if err.reason != Reason.UNREACHABLE or self.num_shards == 1:
                    raise
                error = err
                continue
            answered += 1
            self._count(received=reply.ByteSize())
            versions.update(reply.versions)
            run_step = max(run_step, reply.run_step)
        if not answered:
            raise error
        return Beat(versions=versions, run_step=run_step)

    def subscribe(self, island: int, versions: Callable[[], dict[int, int]], *,
                  on_request: Callable[[RoundRequest], None], on_version: Callable[[VersionUpdate], None],
                  on_reconnect: Callable[[], None] = lambda: None) -> Subscription:
        """Start reading this island's events from every shard (one thread each).

        ``versions()`` tells, at each (re)connect, which version of each fragment the island holds;
        ``on_request(request)`` and ``on_version(update)`` run on the reader
        threads; ``on_reconnect()`` when a stream that had worked is open again (contributions
        waiting in rounds may have been lost with a restarted synchronizer).
        """
        subscription = Subscription(island, self.shard_sessions, open_stream=self._open_stream, closed=lambda: self.closed,
                                    count_received=lambda n: self._count(received=n), backoff=self.backoff, rng=self.rng,
                                    versions=versions, on_request=on_request, on_version=on_version, on_reconnect=on_reconnect)
        with self._lock:  # started under the lock, so a close at the same time finds it and joins it
            self._check_open("subscribe")  # its readers would retry the closed channels for ever, never joined
            self._subscriptions.append(subscription)
            return subscription.start()

    def _open_stream(self, shard: int, request: pb.SubscribeRequest):
        """A subscription's event stream from ``shard`` (transport/wire.py's events)."""
        return self.stubs[shard].Subscribe(request, metadata=self.metadata)

    def leave(self, island: int) -> None:
        """Tell every joined shard that this island leaves the run (its training ended, or it is
        stopping), so that no round waits for it. One attempt per shard, within
        :data:`LEAVE_TIMEOUT`: a synchronizer that is away is not waited for (it stops waiting for
        the island after its liveness timeout instead). Raises the first failure, after trying
        every shard.

        From here on the client does not join again by itself: the subscription ends, and a call
        the synchronizer answers ``not_joined`` fails instead of joining again (which would put
        the island back into the run). :meth:`join` starts over."""
        self._check_open("leave")
        sessions = self.shard_sessions.leave()  # no rejoin is under way, and none starts after this
        with self._lock:
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            subscription.stop()
        failure = None
        for shard, session in enumerate(sessions):
            if not session:  # absent: it does not know this island's session anyway
                continue
            try:
                self.stubs[shard].Leave(pb.LeaveRequest(island=island, session=session), timeout=LEAVE_TIMEOUT,
                                        metadata=self.metadata)
            except grpc.RpcError as err:
                code, details = err.code(), err.details() or ""
                away = code in RETRYABLE + (grpc.StatusCode.DEADLINE_EXCEEDED,)
                failure = failure or SynchronizerError(code, Reason.UNREACHABLE if away else Reason.parse(details),
                                                       f"leave of shard {shard} failed ({code.name}): {details}")
            except ValueError:  # gRPC's "closed channel": closed under the call
                self._check_open("leave")
                raise
        if failure is not None:
            raise failure

    def status(self, shard: int = 0) -> SynchronizerStatus:
        reply = self._call("status", lambda: self.stubs[shard].Status(pb.StatusRequest(), timeout=self.timeout, metadata=self.metadata))
        return from_message(reply, SynchronizerStatus)

    def export_shard(self, shard: int) -> ShardModel:
        """What shard ``shard`` holds of the global model, read with the operator's credential
        (the run's token): its layout and the exact value of each fragment it owns. It joins
        nothing and changes nothing in the run (the server's ExportLayout, ExportFragment)."""
        shard_stub = self.stubs[shard]
        reply = self._call(f"export layout of shard {shard}", lambda: shard_stub.ExportLayout(
            pb.ExportLayoutRequest(), timeout=self.timeout, metadata=self.metadata))  # no shard: no session to check
        if reply.shard != shard or reply.num_shards != self.num_shards:
            raise ValueError(f"{self.addresses[shard]} is shard {reply.shard} of {reply.num_shards}, given as shard {shard} of "
                             f"{self.num_shards}: give every shard's address, in shard order (as the islands were given them)")
        layout = FragmentLayout.from_dict(json.loads(reply.layout_json))
        values, versions = {}, dict(reply.versions)
        for p in sorted(p for p, version in versions.items() if version >= 0):  # unseeded: GlobalModel.from_shards names it
            what = f"export of fragment {p}"

            def call(p=p, what=what):
                replies = shard_stub.ExportFragment(pb.ExportFragmentRequest(fragment=p), timeout=self.timeout,
                                                    metadata=self.metadata)
                h, data = self._receive(replies, what)
                return h.version, get_codec(EXACT).decode(data, len(data) // 4)

            versions[p], values[p] = self._call(what, call)
            if values[p].numel() != layout.fragment_numel(p):
                raise ValueError(f"{what}: {self.addresses[shard]} sent {values[p].numel()} values for a fragment of "
                                 f"{layout.fragment_numel(p)} in its own layout; is it a synchronizer of this version?")
        return ShardModel(source=self.addresses[shard], run_id=reply.run_id or None, shard=reply.shard,
                          num_shards=reply.num_shards, layout=layout, values=values, versions=versions)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _check_open(self, what: str) -> None:
        if self._closed.is_set():
            raise SynchronizerError(None, Reason.UNREACHABLE,
                                    f"{what}: the client of the synchronizer at {','.join(self.addresses)} is closed")

    def close(self) -> None:
        """End the subscriptions and join their threads, then release the channels; later calls
        fail as unreachable, saying the client is closed.

        When it returns, from whichever caller (two closing at once included), no reader thread
        of this client runs, but one still inside a callback after ``JOIN_TIMEOUT``: that one is
        logged, naming the callback, and hands no further event (core/readers.py).
        """
        with self._lock:
            self._closed.set()
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            subscription.stop()
        for channel in self.channels:  # also ends a call backing off and a reader's join in flight (a rejoin)
            channel.close()
        for subscription in subscriptions:  # each close joins them: a second one returns once they ended too
            subscription.join()

    def __enter__(self) -> SynchronizerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- streaming helpers ----------------------------------------------------------------------

    def _counted(self, messages: Iterator[bytes]) -> Iterator[bytes]:
        for message in messages:
            self._count(sent=len(message))
            yield message

    def _receive(self, replies: Iterator[Chunk], what: str) -> tuple[pb.FragmentHeader, memoryview]:
        first = next(replies)
        self._count(received=first.size)
        header = first.header or pb.FragmentHeader()
        data = assemble(first, self._counted_in(replies), header.payload_bytes, what)
        return header, data

    def _counted_in(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        for chunk in chunks:
            self._count(received=chunk.size)
            yield chunk
