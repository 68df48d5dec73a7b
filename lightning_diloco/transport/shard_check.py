"""Whether the addresses a client was given are the shards of one run, and if not, what differs.

Checked on every join, before any shard's session is used: the same run settings on every shard
(the differing ones named), the same shard count, and shard i at the i-th address, once each
(different H per shard was a bare SHARD_MISMATCH, and two processes started as
``--shard 0`` were accepted until the first seed failed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _flat(settings: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def shard_mismatch(addresses: Sequence[str], replies: Mapping[int, Any]) -> str | None:
    """Why ``replies`` (each shard's :class:`~lightning_diloco.transport.shard_transport.ShardJoin`
    by address index; shards not joined are missing) are not one run's shards, or None."""
    total = len(addresses)
    indices = sorted(replies)
    addresses, ordered = [addresses[i] for i in indices], [replies[i] for i in indices]
    counts = {r.num_shards for r in ordered}
    if counts != {total}:
        said = ", ".join(f"{a} says {r.num_shards}" for a, r in zip(addresses, ordered))
        return f"{total} addresses were given, but the synchronizers count other numbers of shards ({said})"
    for index, address, reply in zip(indices, addresses, ordered):
        if reply.shard != index:
            return (f"the synchronizer at {address} is shard {reply.shard}, but it is address {index} of the list: give "
                    "the shards' addresses in shard order, each shard once (was one started with the wrong --shard?)")
    settings = [_flat(r.info.config.to_dict()) for r in ordered]
    for key in sorted(set().union(*settings)):
        values = [s.get(key) for s in settings]
        if len(set(map(repr, values))) > 1:
            said = ", ".join(f"{a}: {v!r}" for a, v in zip(addresses, values))
            return f"the shards run with different settings: {key} differs ({said}); start every shard with the same settings"
    return None
