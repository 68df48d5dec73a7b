"""The island's link to a remote synchronizer, over gRPC, and the operator's read of its shards.

:class:`SynchronizerClient` is the island's link (transport/island_link.py: retries, sessions
and rejoin, absent shards, subscriptions, leave, close) over the gRPC transport
(transport/grpc_shards.py), with what only a remote synchronizer offers beside it: the export of
a shard's global fragments with the operator's credential.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_diloco.core.codecs import EXACT, get_codec
from lightning_diloco.core.fragments import FragmentLayout, TensorSpec
from lightning_diloco.core.global_model import ShardModel
from lightning_diloco.core.protocol import JoinInfo
from lightning_diloco.reasons import SynchronizerError
from lightning_diloco.transport import synchronizer_pb2 as pb
from lightning_diloco.transport.grpc_shards import GrpcShards
from lightning_diloco.transport.island_link import IslandLink
from lightning_diloco.transport.resolve import RESOLVE_PATIENCE, check_resolves

__all__ = ["SynchronizerClient", "SynchronizerError", "parse_addresses"]


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


class SynchronizerClient(IslandLink):
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
    ) -> None:
        """``timeout``: seconds per call. ``max_retries``: attempts after the first on an
        unreachable synchronizer, with delays ``backoff * 2**k`` capped at ``max_backoff``, each
        jittered by up to 50%."""
        self.grpc = GrpcShards(parse_addresses(addresses), token=token, tls_root_cert=tls_root_cert, timeout=timeout)
        super().__init__(self.grpc, max_retries=max_retries, backoff=backoff, max_backoff=max_backoff)
        self.timeout, self.metadata, self.stubs = timeout, self.grpc.metadata, self.grpc.stubs

    def join(self, island: int, world_size: int, specs: Sequence[TensorSpec], patience: float = 0.0,
             num_islands: int = 0, patience_setting: str = "") -> JoinInfo:
        """As :meth:`IslandLink.join`, after checking that every host of the addresses resolves
        (a ``ValueError`` naming the host within ``RESOLVE_PATIENCE`` seconds otherwise)."""
        check_resolves(self.addresses, min(patience, RESOLVE_PATIENCE))
        return super().join(island, world_size, specs, patience=patience, num_islands=num_islands,
                            patience_setting=patience_setting)

    @property
    def bytes_sent(self) -> int:
        return self.grpc.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.grpc.bytes_received

    def export_shard(self, shard: int) -> ShardModel:
        """What shard ``shard`` holds of the global model, read with the operator's credential
        (the run's token): its layout and the exact value of each fragment it owns. It joins
        nothing and changes nothing in the run (the server's ExportLayout, ExportFragment)."""
        shard_stub = self.stubs[shard]
        reply = self._call(f"export layout of shard {shard}", lambda: self.grpc.grpc_call(lambda: shard_stub.ExportLayout(
            pb.ExportLayoutRequest(), timeout=self.timeout, metadata=self.metadata)))  # no shard: no session to check
        if reply.shard != shard or reply.num_shards != self.num_shards:
            raise ValueError(f"{self.addresses[shard]} is shard {reply.shard} of {reply.num_shards}, given as shard {shard} of "
                             f"{self.num_shards}: give every shard's address, in shard order (as the islands were given them)")
        layout = FragmentLayout.from_dict(json.loads(reply.layout_json))
        values, versions = {}, dict(reply.versions)
        for p in sorted(p for p, version in versions.items() if version >= 0):  # unseeded: GlobalModel.from_shards names it
            what = f"export of fragment {p}"

            def call(p=p, what=what) -> tuple[int, torch.Tensor]:
                def read():
                    replies = shard_stub.ExportFragment(pb.ExportFragmentRequest(fragment=p), timeout=self.timeout,
                                                        metadata=self.metadata)
                    return self.grpc.receive(replies, what)

                h, data = self.grpc.grpc_call(read)
                return h.version, get_codec(EXACT).decode(data, len(data) // 4)

            versions[p], values[p] = self._call(what, call)
            if values[p].numel() != layout.fragment_numel(p):
                raise ValueError(f"{what}: {self.addresses[shard]} sent {values[p].numel()} values for a fragment of "
                                 f"{layout.fragment_numel(p)} in its own layout; is it a synchronizer of this version?")
        return ShardModel(source=self.addresses[shard], run_id=reply.run_id or None, shard=reply.shard,
                          num_shards=reply.num_shards, layout=layout, values=values, versions=versions)
