"""Protocol records (core/protocol.py) to and from their gRPC messages, field by field by name.

One generic conversion instead of a hand-written copy per field: a field that exists on one side
only raises here (and in tests/transport/test_messages.py) rather than silently reading as 0.
A record that carries a payload (a :class:`~lightning_diloco.core.protocol.Contribution`, a
:class:`~lightning_diloco.core.protocol.VersionUpdate`) travels as a header message, every field
but ``payload`` by name plus the payload's size, and the payload in chunks (wire.py):
:func:`to_header` and :func:`from_header`. The join reply carries the run settings as JSON, so it
is converted by hand (join_reply).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

from google.protobuf.message import Message

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.protocol import JoinInfo
from lightning_diloco.transport import synchronizer_pb2 as pb

T = TypeVar("T")
M = TypeVar("M", bound=Message)


def to_message(record: Any, message: M) -> M:
    """``message`` (a new, empty one) filled from ``record``'s fields of the same names."""
    return _fill(message, record)


def from_message(message: Message, cls: type[T]) -> T:
    """A ``cls`` record read from ``message``'s fields of the same names."""
    return _read(message, cls)


def join_reply(info: JoinInfo, *, shard: int, num_shards: int) -> pb.JoinReply:
    return pb.JoinReply(config_json=json.dumps(info.config.to_dict()), layout_hash=info.layout_hash,
                        versions=info.versions, shard=shard, num_shards=num_shards, run_step=info.run_step,
                        session=info.session, incarnation=info.incarnation)


def join_info(reply: pb.JoinReply) -> JoinInfo:
    return JoinInfo(config=RunConfig.from_dict(json.loads(reply.config_json)), layout_hash=reply.layout_hash,
                    versions=dict(reply.versions), run_step=reply.run_step, session=reply.session,
                    incarnation=reply.incarnation)


def to_header(record: Any, message: M, payload_bytes: int) -> M:
    """``message`` (a new, empty header: ``PushHeader``, ``FragmentHeader``) filled from every
    field of ``record`` but its payload, and declaring ``payload_bytes``."""
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.name != PAYLOAD and value is not None:  # None: an optional field left unset
            setattr(message, f.name, value)
    message.payload_bytes = payload_bytes
    return message


def from_header(message: Message, cls: type[T], payload: Any = b"") -> T:
    """A ``cls`` record read from a header message's fields of the same names, carrying ``payload``."""
    values = {f.name: getattr(message, f.name) for f in dataclasses.fields(cls) if f.name != PAYLOAD}  # type: ignore[arg-type]  # cls is a dataclass
    return cls(**values, payload=payload)  # type: ignore[call-arg]  # a record with a payload field


PAYLOAD = "payload"
"""The field of a record that travels in chunks after its header, never in it."""


def _fill(message: Message, record: Any) -> Message:
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if value is None:  # an optional field left unset
            continue
        if dataclasses.is_dataclass(value):
            _fill(getattr(message, f.name), value)
        elif isinstance(value, dict):
            target = getattr(message, f.name)
            for key, item in value.items():
                if dataclasses.is_dataclass(item):
                    _fill(target[key], item)
                else:
                    target[key] = item
        elif isinstance(value, list):
            getattr(message, f.name).extend(value)
        else:
            setattr(message, f.name, value)
    return message


def _read(message: Message, cls: Any) -> Any:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kind, optional = _unwrap_optional(hints[f.name])
        if optional and not message.HasField(f.name):
            values[f.name] = None
            continue
        value = getattr(message, f.name)
        origin = typing.get_origin(kind)
        if dataclasses.is_dataclass(kind):
            values[f.name] = _read(value, kind)
        elif origin is dict:
            item = typing.get_args(kind)[1]
            values[f.name] = {k: (_read(v, item) if dataclasses.is_dataclass(item) else v) for k, v in value.items()}
        elif origin is list:
            values[f.name] = list(value)
        else:
            values[f.name] = value
    return cls(**values)


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (hint, False)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False
