"""The gRPC face of :class:`~lightning_diloco.synchronizer.service.Synchronizer`.

Thin by design: authenticate, reassemble chunked payloads, call the service, stream the reply.
Every refusal becomes a gRPC status whose details start with the reason code.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
from concurrent import futures
from pathlib import Path

import grpc
from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.fragments import TensorSpec
from lightning_diloco.core.threads import single_threaded_torch
from lightning_diloco.synchronizer.service import Contribution, Refusal, Synchronizer
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport import synchronizer_pb2_grpc as pb_grpc
from lightning_diloco.transport.chunks import MAX_MESSAGE_BYTES, assemble, iter_chunks

log = logging.getLogger(__name__)

DEFAULT_PUSH_WAIT = 300.0


def _handler(method):
    """Authenticate, then turn refusals and timeouts into gRPC statuses."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            self.authorize(context)
            # Streaming replies are returned as generators built after the work is done, so every
            # refusal is raised here, before the first message goes out.
            return method(self, request, context)
        except Refusal as refusal:
            context.abort(grpc.StatusCode[refusal.status], f"{refusal.reason}: {refusal}")
        except TimeoutError as err:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"round_open: {err}")

    return wrapper


class SynchronizerServicer(pb_grpc.SynchronizerServicer):
    def __init__(self, service: Synchronizer, token: str | None = None) -> None:
        self.service, self.token = service, token

    def authorize(self, context: grpc.ServicerContext) -> None:
        if not self.token:
            return
        metadata = dict(context.invocation_metadata())
        given = metadata.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise self.service.refuse_auth("missing or wrong token; pass the run's token (DILOCO_TOKEN)")

    def _payload(self, first, rest, expected: int, declared: int, what: str) -> bytearray:
        if declared != expected:
            raise self.service.refuse(
                "bad_payload", f"{what} declares {declared} bytes but its codec and fragment need {expected}"
            )
        try:
            return assemble(first.data, rest, expected, what)
        except ValueError as err:
            raise self.service.refuse("bad_payload", str(err)) from None

    @_handler
    def Join(self, request, context):
        specs = [TensorSpec(name=t.name, shape=tuple(t.shape), dtype=t.dtype, role=t.role) for t in request.tensors]
        try:
            reply = self.service.join(request.island, request.world_size, specs)
        except ValueError as err:  # a malformed spec, e.g. an unknown role
            raise self.service.refuse("layout_mismatch", str(err)) from None
        return pb.JoinReply(
            config_json=json.dumps(reply["config"]),
            layout_hash=reply["layout_hash"],
            versions=reply["versions"],
            shard=self.service.shard,
            num_shards=self.service.num_shards,
        )

    @_handler
    def Seed(self, request_iterator, context):
        first = next(request_iterator)
        h = first.header
        expected = self.service.expected_payload_bytes("fp32", h.fragment)
        payload = self._payload(first, request_iterator, expected, h.payload_bytes, f"seed of fragment {h.fragment}")
        seeded = self.service.seed(h.island, h.fragment, payload)
        return pb.SeedReply(seeded=seeded, version=self.service.versions()[h.fragment])

    @_handler
    def Push(self, request_iterator, context):
        first = next(request_iterator)
        h = first.header
        expected = self.service.expected_payload_bytes(h.codec, h.fragment)
        payload = self._payload(first, request_iterator, expected, h.payload_bytes, f"push of fragment {h.fragment}")
        contribution = Contribution(
            island=h.island,
            fragment=h.fragment,
            base_version=h.base_version,
            tokens=h.tokens,
            steps=h.steps,
            codec=h.codec,
            seq=h.seq,
            payload=payload,
            layout_hash=h.layout_hash,
        )
        remaining = context.time_remaining()
        wait = DEFAULT_PUSH_WAIT if remaining is None else max(0.0, min(DEFAULT_PUSH_WAIT, remaining - 0.05))
        reply = self.service.push(contribution, timeout=wait)
        header = pb.FragmentHeader(
            fragment=reply.fragment,
            version=reply.version,
            base_version=reply.base_version,
            codec=reply.codec,
            payload_bytes=reply.payload.numel(),
            contributors=reply.contributors,
            reason=reply.reason,
        )
        return iter_chunks(header, reply.payload, pb.FragmentChunk)

    @_handler
    def Pull(self, request, context):
        remaining = context.time_remaining()
        wait = request.wait_seconds if remaining is None else max(0.0, min(request.wait_seconds, remaining - 0.05))
        version, value = self.service.pull(request.fragment, request.newer_than, timeout=wait)
        payload = get_codec("fp32").encode(value)
        header = pb.FragmentHeader(fragment=request.fragment, version=version, base_version=-1, codec="fp32", payload_bytes=payload.numel())
        return iter_chunks(header, payload, pb.FragmentChunk)

    @_handler
    def Heartbeat(self, request, context):
        self.service.heartbeat(request.island, request.steps, request.step_time)
        return pb.HeartbeatReply(versions=self.service.versions())

    @_handler
    def Status(self, request, context):
        return pb.StatusReply(json=json.dumps(self.service.status()))


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
        """``max_workers`` bounds concurrent calls; a push holds a worker while its round is open,
        so allow at least islands x (overlap_steps + 1) plus a few."""
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
        pb_grpc.add_SynchronizerServicer_to_server(SynchronizerServicer(service, token), self.server)
        address = f"{host}:{port}"
        if tls_cert or tls_key:
            if not (tls_cert and tls_key):
                raise ValueError("TLS needs both a certificate and a key file (--tls-cert and --tls-key)")
            credentials = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"could not bind the synchronizer to {address}; is the port in use?")
        self.address = f"{host}:{self.port}"
        self._stopped = False

    def start(self) -> SynchronizerServer:
        self.server.start()
        log.info("synchronizer shard %d/%d listening on %s", self.service.shard, self.service.num_shards, self.address)
        return self

    def stop(self, grace: float = 1.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.service.shutdown()
        self.server.stop(grace).wait()
        self.executor.shutdown(wait=True)  # grpc leaves its worker threads to us
        self.service.checkpoint()

    def wait(self) -> None:
        self.server.wait_for_termination()

    def __enter__(self) -> SynchronizerServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(grace=0.2)

