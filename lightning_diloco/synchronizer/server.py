"""The gRPC face of :class:`~lightning_diloco.synchronizer.service.Synchronizer`.

Thin by design: authenticate, reassemble chunked payloads, call the service, stream the reply.
Every refusal becomes a gRPC status whose details start with the reason code.

Every call is under the same resource rules, so that one island's credential cannot take what
the others need: it is checked from its header (session, fragment, sizes) before anything is
read or copied; a stream that can last, and a call that can hold a worker for long, takes a slot
(slots.py); and a payload must arrive, and a pull's reply be read, within a deadline after which
the stream is cancelled (deadlines.py).
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc

from lightning_diloco.core.codecs import EXACT, get_codec
from lightning_diloco.core.fragments import TensorSpec
from lightning_diloco.core.protocol import Contribution, RoundRequest
from lightning_diloco.core.threads import single_threaded_torch
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.credentials import Caller, identify
from lightning_diloco.synchronizer.deadlines import StreamDeadlines, payload_deadline
from lightning_diloco.synchronizer.push_admission import declared_size_problem
from lightning_diloco.synchronizer.requests import Refusal
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.slots import EXPORTS_AT_ONCE, OPERATOR, PULLS_PER_ISLAND, SUBSCRIPTIONS_PER_ISLAND, Slots
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport import synchronizer_pb2_grpc as pb_grpc
from lightning_diloco.transport.chunks import MAX_MESSAGE_BYTES
from lightning_diloco.transport.messages import from_header, join_reply, to_message
from lightning_diloco.transport.wire import DownlinkMessages, add_servicer, assemble, chunk_messages

log = logging.getLogger(__name__)

MAX_DETAILS = 1000  # characters of a refusal's message sent back: it may quote client input
STATUS = {  # which gRPC status code carries each refusal; INVALID_ARGUMENT for the rest
    Reason.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Reason.UNKNOWN_FRAGMENT: grpc.StatusCode.OUT_OF_RANGE,
    Reason.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.TOO_MANY_ISLANDS: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Reason.ISLAND_RUNNING: grpc.StatusCode.ALREADY_EXISTS,
    **dict.fromkeys([Reason.LAYOUT_MISMATCH, Reason.NOT_JOINED, Reason.NOT_SEEDED, Reason.WRONG_SESSION,
                     Reason.OLD_SEQUENCE, Reason.SEQUENCE_REUSED, Reason.NUM_ISLANDS_MISMATCH],
                    grpc.StatusCode.FAILED_PRECONDITION),
}


def _handler(method):
    """Authenticate, then turn refusals and timeouts into gRPC statuses. The method gets the
    caller its credential proves (credentials.py) and checks the island it acts as."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            caller = self.authorize(context)
            # Streaming replies are returned as generators built after the work is done, so every
            # refusal is raised here, before the first message goes out.
            return method(self, request, context, caller)
        except Refusal as refusal:
            _abort(context, refusal)
        except StopIteration:  # a client stream that ended before its first message
            _abort(context, self.service.tally.refuse(Reason.BAD_PAYLOAD, f"the {method.__name__} stream carried no message"))

    return wrapper


def _abort(context: grpc.ServicerContext, refusal: Refusal) -> None:
    code = STATUS.get(refusal.reason, grpc.StatusCode.INVALID_ARGUMENT)
    context.abort(code, f"{refusal.reason}: {refusal}"[:MAX_DETAILS])


def _events(events: Iterator, context: grpc.ServicerContext, release, downlink: DownlinkMessages) -> Iterator[pb.SyncEvent | bytes]:
    """Subscription events as messages; a version is streamed in chunks, its header on the first,
    serialized once for every island that gets the same delta."""
    try:
        for event in events:
            if isinstance(event, RoundRequest):
                yield pb.SyncEvent(request=to_message(event, pb.RoundRequest()))
                continue
            yield from downlink.messages(event)
    except Refusal as refusal:
        _abort(context, refusal)
    finally:
        release()


class SynchronizerServicer(pb_grpc.SynchronizerServicer):
    def __init__(self, service: Synchronizer, token: str | None = None, max_workers: int = 256) -> None:
        self.service, self.token = service, token
        # a call that holds its worker for long takes a slot; when none is left it is refused
        # at once, so Status, joins and pushes always find a worker
        self.slots = Slots(service.tally, max_workers)
        self.deadlines = StreamDeadlines()
        self.downlink = DownlinkMessages()

    def authorize(self, context: grpc.ServicerContext) -> Caller:
        if not self.token:
            return Caller(None)
        metadata = dict(context.invocation_metadata())
        given = metadata.get("authorization", "")
        caller = identify(self.token, given[len("Bearer "):]) if given.startswith("Bearer ") else None
        if caller is None:
            raise self.service.tally.refuse(Reason.UNAUTHENTICATED, "missing or wrong token; pass the run's token or this island's "
                                      "credential (DILOCO_TOKEN; `lightning-diloco credential --island I` prints it)")
        return caller

    def acting_as(self, caller: Caller, island: int) -> None:
        """Refuse a call for ``island`` whose credential is another island's."""
        if not caller.may_act_as(island):
            raise self.service.tally.refuse(Reason.UNAUTHENTICATED, f"the credential of island {caller.island} cannot act as island "
                                      f"{island}; each island presents its own (`lightning-diloco credential --island {island}`)")

    def operator_only(self, caller: Caller, what: str) -> None:
        """Refuse ``what`` to an island credential: the export reads the whole global model, a
        copy of every fragment, which is the operator's to take (the run's token), not an island's."""
        if caller.island is not None:
            raise self.service.tally.refuse(Reason.UNAUTHENTICATED, f"the credential of island {caller.island} cannot {what}: "
                                      "it takes the run's token (the operator's; --token-file or $DILOCO_TOKEN)")

    def _payload(self, context, first, rest, island: int, expected: int, what: str) -> memoryview:
        """The payload after its header (a seed's or a push's), read in one of ``island``'s payload
        stream slots; a client that sends it too slowly is cancelled (deadlines.py)."""
        # an island pushes at most one stream per fragment, plus retries overlapping the old ones
        release = self.slots.island(island, "payload", self.service.run.config.schedule.num_fragments + 2)
        seconds = payload_deadline(expected)
        done = self.deadlines.watch(context, seconds)
        try:
            return assemble(first, rest, expected, what)
        except ValueError as err:
            raise self.service.tally.refuse(Reason.BAD_PAYLOAD, str(err)) from None
        except grpc.RpcError:  # cancelled by its deadline (or by the client): counted, the stream is gone
            raise self.service.tally.refuse(Reason.BAD_PAYLOAD, f"{what}: its {expected} bytes did not arrive within "
                                      f"{seconds:.0f} s; a link this slow needs smaller fragments") from None
        finally:
            done()
            release()

    def _until_read(self, context: grpc.ServicerContext, payload_bytes: int, release) -> None:
        """Hold a reply's slots (``release``) until the call ends: read in full, or cancelled by
        its deadline. gRPC keeps a reply's bytes (and, past what it buffers, the worker sending
        them) until its client reads them, so an unread pull holds its copy of the fragment
        until then, never past the deadline (deadlines.py)."""
        done = self.deadlines.watch(context, payload_deadline(payload_bytes))

        def ended() -> None:
            done()
            release()

        if not context.add_callback(ended):  # the call has ended already
            ended()

    @_handler
    def Join(self, request, context, caller):
        self.acting_as(caller, request.island)
        self.service.run.admit_join(len(request.tensors))
        try:
            specs = [TensorSpec(name=t.name, shape=tuple(t.shape), dtype=t.dtype, role=t.role) for t in request.tensors]
            # unset is "": no session to present, as a new process (a join that left it out, once
            # taken for an older client's and not checked, took a live island's slot: issue 48)
            reply = self.service.join(request.island, request.world_size, specs, num_islands=request.num_islands,
                                      previous_session=request.previous_session)
        except ValueError as err:  # a malformed spec, e.g. an unknown role
            raise self.service.tally.refuse(Reason.LAYOUT_MISMATCH, str(err)) from None
        return join_reply(reply, shard=self.service.shard, num_shards=self.service.num_shards)

    @_handler
    def Seed(self, request_iterator, context, caller):
        first = next(request_iterator)
        h = first.header
        self.acting_as(caller, h.island)
        version, expected = self.service.admit_seed(h.island, h.fragment, h.session)
        what = f"seed of fragment {h.fragment}"
        problem = declared_size_problem(what, h.payload_bytes, expected)
        if problem:
            raise self.service.tally.refuse(Reason.BAD_PAYLOAD, problem)
        if version is not None:  # the first offer won: answered from the header, the payload never read
            return pb.SeedReply(seeded=False, version=version)
        payload = self._payload(context, first, request_iterator, h.island, expected, what)
        seeded = self.service.seed(h.island, h.fragment, payload, session=h.session)
        return pb.SeedReply(seeded=seeded, version=self.service.versions()[h.fragment])

    @_handler
    def Push(self, request_iterator, context, caller):
        first = next(request_iterator)
        h = first.header
        self.acting_as(caller, h.island)
        header = from_header(h, Contribution)  # its payload is read once the header is admitted

        def receive(expected: int) -> memoryview:  # asked once the header is admitted: not a byte is read before
            return self._payload(context, first, request_iterator, h.island, expected, f"push of fragment {h.fragment}")

        ack = self.service.push(header, declared_bytes=h.payload_bytes, receive=receive)  # one call per push
        return to_message(ack, pb.PushAck())

    @_handler
    def Subscribe(self, request, context, caller):
        self.acting_as(caller, request.island)
        # a joined island's own slots first (a reconnect may overlap the old stream's last tick),
        # so one client's subscriptions never take the workers every other island needs; the
        # session is checked before a long-call slot is taken
        own = self.slots.island(request.island, "subscription", SUBSCRIPTIONS_PER_ISLAND)
        try:
            events = self.service.subscribe(request.island, dict(request.versions), active=context.is_active,
                                            session=request.session)
            shared = self.slots.long_call("subscription")
        except Refusal:
            own()
            raise
        return _events(events, context, lambda: (shared(), own()), self.downlink)

    @_handler
    def Pull(self, request, context, caller):
        self.acting_as(caller, request.island)
        self.service.admit_pull(request.island, request.fragment, request.session)
        # gRPC sends a reply as fast as its client reads it: one never read holds its worker
        release = self.slots.island_long_call(request.island, "pull", PULLS_PER_ISLAND)
        return self._whole_fragment(context, request.fragment, functools.partial(self.service.pull, island=request.island),
                                    release)

    @_handler
    def Heartbeat(self, request, context, caller):
        self.acting_as(caller, request.island)
        beat = self.service.heartbeat(request.island, request.steps, request.step_time, request.schedule_step,
                                      session=request.session)
        return to_message(beat, pb.HeartbeatReply())

    @_handler
    def Leave(self, request, context, caller):
        self.acting_as(caller, request.island)
        self.service.leave(request.island, session=request.session)
        return pb.LeaveReply()

    @_handler
    def Status(self, request, context, caller):
        return to_message(self.service.status(), pb.StatusReply())

    @_handler
    def ExportLayout(self, request, context, caller):
        self.operator_only(caller, "export the global model")
        layout, versions = self.service.export_layout()
        return pb.ExportLayoutReply(layout_json=json.dumps(layout.to_dict()), run_id=self.service.directory.identity["run_id"] or "",
                                    shard=self.service.shard, num_shards=self.service.num_shards, versions=versions)

    @_handler
    def ExportFragment(self, request, context, caller):
        self.operator_only(caller, "export the global model")
        self.service.export_layout()  # refused the same way before an island has joined
        # under the same rules as a pull: the operator's own few slots, a long-call slot, and a
        # reply read within its deadline, so an export never holds what the islands need
        release = self.slots.island_long_call(OPERATOR, "export", EXPORTS_AT_ONCE)
        return self._whole_fragment(context, request.fragment, self.service.export, release)

    def _whole_fragment(self, context, fragment: int, read, release: Callable[[], None]):
        """A whole fragment's value, exact, as ``read(fragment)`` gives it (version, value), in
        chunks the client must read within the deadline; ``release`` frees the long-call slot
        taken for it (at once if the read is refused)."""
        try:
            version, value = read(fragment)
        except Refusal:
            release()
            raise
        payload = get_codec(EXACT).encode(value)
        self._until_read(context, payload.numel(), release)
        header = pb.FragmentHeader(fragment=fragment, version=version, base_version=-1, codec=EXACT,
                                   payload_bytes=payload.numel())
        return chunk_messages(header, payload)


class SynchronizerServer:
    """A running gRPC server around a service; ``stop`` writes a final checkpoint."""

    def __init__(
        self,
        service: Synchronizer,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        max_workers: int = 256,
    ) -> None:
        """``max_workers`` bounds concurrent calls; each island's subscription holds one worker for
        as long as it is connected, so allow at least islands x shards plus a few."""
        self.service = service
        # embedded in a training process, the handlers' torch work must not add OpenMP teams
        self.executor = futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="diloco-sync", initializer=single_threaded_torch
        )
        self.server = grpc.server(
            self.executor,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        self.servicer = SynchronizerServicer(service, token, max_workers)
        add_servicer(self.servicer, self.server)
        address = f"{host}:{port}"
        if tls_cert or tls_key:
            if not (tls_cert and tls_key):
                raise ValueError("TLS needs both a certificate and a key file (--tls-cert and --tls-key)")
            credentials = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
            bind = lambda: self.server.add_secure_port(address, credentials)  # noqa: E731 - one call, two ways
        else:
            bind = lambda: self.server.add_insecure_port(address)  # noqa: E731 - one call, two ways
        try:
            self.port = bind()
        except RuntimeError:  # grpc >= 1.60 raises where older ones returned 0
            self.port = 0
        if self.port == 0:
            self.executor.shutdown(wait=False)
            tls = " (or --tls-cert and --tls-key are not a PEM certificate and its key)" if tls_cert else ""
            raise ValueError(f"cannot listen on {address}: the port is in use (another synchronizer?) or {host} is "
                             f"not an address of this host{tls}; choose another --port (0 picks a free one) or --host")
        self.address = f"{host}:{self.port}"
        self._started = self._stopped = False

    def start(self) -> SynchronizerServer:
        self.service.start()
        self.server.start()
        self._started = True
        log.info("synchronizer shard %d/%d listening on %s", self.service.shard, self.service.num_shards, self.address)
        return self

    def stop(self, grace: float = 1.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.service.shutdown(keep_checkpoint_dir=True)  # until the final checkpoint is written
        try:
            if not self._started:  # grpc closes a bound port only when a started server stops
                self.server.start()
            self.server.stop(grace).wait()
            self.servicer.deadlines.close()
            self.executor.shutdown(wait=True)  # grpc leaves its worker threads to us
            self.service.checkpoint()
        finally:
            self.service.directory.release()

    def wait(self) -> None:
        self.server.wait_for_termination()

    def __enter__(self) -> SynchronizerServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=0.2)

