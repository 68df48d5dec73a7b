"""The synchronizer's status dataclasses to and from their gRPC message, field by field by name.

One generic conversion instead of a hand-written copy per field: a field that exists on one side
only raises here (and in tests/unit/synchronizer/test_status.py) rather than silently reading as 0.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from google.protobuf.message import Message

from lightning_diloco.synchronizer.status import SynchronizerStatus
from lightning_diloco.transport import synchronizer_pb2 as pb

T = TypeVar("T")


def status_to_message(status: SynchronizerStatus) -> pb.StatusReply:
    return _fill(pb.StatusReply(), status)


def status_from_message(message: pb.StatusReply) -> SynchronizerStatus:
    if not message.incarnation:  # every synchronizer that sends the typed fields names its process
        raise ValueError("the synchronizer answered Status in an older format (a JSON blob, before the typed fields); "
                         "run the same lightning_diloco version for the synchronizer and its clients")
    return _read(message, SynchronizerStatus)


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


def _read(message: Message, cls: type[T]) -> T:
    hints = typing.get_type_hints(cls)
    values = {}
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
