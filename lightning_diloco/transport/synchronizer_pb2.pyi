from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "role")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    role: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("island", "world_size", "tensors", "num_islands", "previous_session")
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_ISLANDS_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SESSION_FIELD_NUMBER: _ClassVar[int]
    island: int
    world_size: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    num_islands: int
    previous_session: str
    def __init__(self, island: _Optional[int] = ..., world_size: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., num_islands: _Optional[int] = ..., previous_session: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("config_json", "layout_hash", "versions", "shard", "num_shards", "run_step", "session", "incarnation")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    layout_hash: str
    versions: _containers.ScalarMap[int, int]
    shard: int
    num_shards: int
    run_step: int
    session: str
    incarnation: str
    def __init__(self, config_json: _Optional[str] = ..., layout_hash: _Optional[str] = ..., versions: _Optional[_Mapping[int, int]] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., run_step: _Optional[int] = ..., session: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("island", "fragment", "base_version", "tokens", "steps", "codec", "seq", "layout_hash", "payload_bytes", "round", "session")
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    island: int
    fragment: int
    base_version: int
    tokens: float
    steps: int
    codec: str
    seq: int
    layout_hash: str
    payload_bytes: int
    round: int
    session: str
    def __init__(self, island: _Optional[int] = ..., fragment: _Optional[int] = ..., base_version: _Optional[int] = ..., tokens: _Optional[float] = ..., steps: _Optional[int] = ..., codec: _Optional[str] = ..., seq: _Optional[int] = ..., layout_hash: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., round: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class FragmentHeader(_message.Message):
    __slots__ = ("fragment", "version", "base_version", "codec", "payload_bytes", "island", "round", "included", "session")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    version: int
    base_version: int
    codec: str
    payload_bytes: int
    island: int
    round: int
    included: bool
    session: str
    def __init__(self, fragment: _Optional[int] = ..., version: _Optional[int] = ..., base_version: _Optional[int] = ..., codec: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., island: _Optional[int] = ..., round: _Optional[int] = ..., included: _Optional[bool] = ..., session: _Optional[str] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("fragment", "round", "late", "duplicate", "version")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    late: bool
    duplicate: bool
    version: int
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., late: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class FragmentChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: FragmentHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[FragmentHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SeedReply(_message.Message):
    __slots__ = ("seeded", "version")
    SEEDED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    seeded: bool
    version: int
    def __init__(self, seeded: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("fragment", "island", "session")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    island: int
    session: str
    def __init__(self, fragment: _Optional[int] = ..., island: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("island", "steps", "step_time", "schedule_step", "session")
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_STEP_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    island: int
    steps: int
    step_time: float
    schedule_step: int
    session: str
    def __init__(self, island: _Optional[int] = ..., steps: _Optional[int] = ..., step_time: _Optional[float] = ..., schedule_step: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("island", "session")
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    island: int
    session: str
    def __init__(self, island: _Optional[int] = ..., session: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("versions", "run_step")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.ScalarMap[int, int]
    run_step: int
    def __init__(self, versions: _Optional[_Mapping[int, int]] = ..., run_step: _Optional[int] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("island", "versions", "session")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    island: int
    versions: _containers.ScalarMap[int, int]
    session: str
    def __init__(self, island: _Optional[int] = ..., versions: _Optional[_Mapping[int, int]] = ..., session: _Optional[str] = ...) -> None: ...

class RoundRequest(_message.Message):
    __slots__ = ("fragment", "round", "due_step")
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DUE_STEP_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    round: int
    due_step: int
    def __init__(self, fragment: _Optional[int] = ..., round: _Optional[int] = ..., due_step: _Optional[int] = ...) -> None: ...

class SyncEvent(_message.Message):
    __slots__ = ("request", "chunk")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    request: RoundRequest
    chunk: FragmentChunk
    def __init__(self, request: _Optional[_Union[RoundRequest, _Mapping]] = ..., chunk: _Optional[_Union[FragmentChunk, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IslandStatus(_message.Message):
    __slots__ = ("live", "world_size", "steps", "schedule_step", "step_time_s", "accepted", "seen_s_ago", "merged_s_ago", "left")
    LIVE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SEEN_S_AGO_FIELD_NUMBER: _ClassVar[int]
    MERGED_S_AGO_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    live: bool
    world_size: int
    steps: int
    schedule_step: int
    step_time_s: float
    accepted: int
    seen_s_ago: float
    merged_s_ago: float
    left: bool
    def __init__(self, live: _Optional[bool] = ..., world_size: _Optional[int] = ..., steps: _Optional[int] = ..., schedule_step: _Optional[int] = ..., step_time_s: _Optional[float] = ..., accepted: _Optional[int] = ..., seen_s_ago: _Optional[float] = ..., merged_s_ago: _Optional[float] = ..., left: _Optional[bool] = ...) -> None: ...

class LastClose(_message.Message):
    __slots__ = ("round", "version", "contributors", "late", "clipped", "dropped", "grace_wait_s", "reason")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    GRACE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    round: int
    version: int
    contributors: int
    late: int
    clipped: int
    dropped: int
    grace_wait_s: float
    reason: str
    def __init__(self, round: _Optional[int] = ..., version: _Optional[int] = ..., contributors: _Optional[int] = ..., late: _Optional[int] = ..., clipped: _Optional[int] = ..., dropped: _Optional[int] = ..., grace_wait_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class RoundStatus(_message.Message):
    __slots__ = ("round", "open", "open_contributors", "waiting_late", "closed", "merged_entries", "merged_late", "superseded", "clipped", "dropped", "grace_wait_total_s", "grace_wait_max_s", "last")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    OPEN_CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    WAITING_LATE_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    MERGED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MERGED_LATE_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDED_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    GRACE_WAIT_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    GRACE_WAIT_MAX_S_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    round: int
    open: bool
    open_contributors: int
    waiting_late: int
    closed: int
    merged_entries: int
    merged_late: int
    superseded: int
    clipped: int
    dropped: int
    grace_wait_total_s: float
    grace_wait_max_s: float
    last: LastClose
    def __init__(self, round: _Optional[int] = ..., open: _Optional[bool] = ..., open_contributors: _Optional[int] = ..., waiting_late: _Optional[int] = ..., closed: _Optional[int] = ..., merged_entries: _Optional[int] = ..., merged_late: _Optional[int] = ..., superseded: _Optional[int] = ..., clipped: _Optional[int] = ..., dropped: _Optional[int] = ..., grace_wait_total_s: _Optional[float] = ..., grace_wait_max_s: _Optional[float] = ..., last: _Optional[_Union[LastClose, _Mapping]] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("shard", "num_shards", "incarnation", "layout_hash", "outer_steps", "run_step", "sync_every", "num_fragments", "min_quorum", "bytes_in", "bytes_out", "checkpoint_failures", "last_checkpoint_error", "last_checkpoint_outer_steps", "versions", "live_islands", "islands", "rounds", "accepted", "refused", "adjustments")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class IslandsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: IslandStatus
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[IslandStatus, _Mapping]] = ...) -> None: ...
    class RoundsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: RoundStatus
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[RoundStatus, _Mapping]] = ...) -> None: ...
    class AcceptedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RefusedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    RUN_STEP_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    MIN_QUORUM_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_OUTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LIVE_ISLANDS_FIELD_NUMBER: _ClassVar[int]
    ISLANDS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ADJUSTMENTS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    num_shards: int
    incarnation: str
    layout_hash: str
    outer_steps: int
    run_step: int
    sync_every: int
    num_fragments: int
    min_quorum: int
    bytes_in: int
    bytes_out: int
    checkpoint_failures: int
    last_checkpoint_error: str
    last_checkpoint_outer_steps: int
    versions: _containers.ScalarMap[int, int]
    live_islands: _containers.RepeatedScalarFieldContainer[int]
    islands: _containers.MessageMap[int, IslandStatus]
    rounds: _containers.MessageMap[int, RoundStatus]
    accepted: _containers.ScalarMap[str, int]
    refused: _containers.ScalarMap[str, int]
    adjustments: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., incarnation: _Optional[str] = ..., layout_hash: _Optional[str] = ..., outer_steps: _Optional[int] = ..., run_step: _Optional[int] = ..., sync_every: _Optional[int] = ..., num_fragments: _Optional[int] = ..., min_quorum: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., checkpoint_failures: _Optional[int] = ..., last_checkpoint_error: _Optional[str] = ..., last_checkpoint_outer_steps: _Optional[int] = ..., versions: _Optional[_Mapping[int, int]] = ..., live_islands: _Optional[_Iterable[int]] = ..., islands: _Optional[_Mapping[int, IslandStatus]] = ..., rounds: _Optional[_Mapping[int, RoundStatus]] = ..., accepted: _Optional[_Mapping[str, int]] = ..., refused: _Optional[_Mapping[str, int]] = ..., adjustments: _Optional[_Iterable[str]] = ...) -> None: ...

class ExportLayoutRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExportLayoutReply(_message.Message):
    __slots__ = ("layout_json", "run_id", "shard", "num_shards", "versions")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    layout_json: str
    run_id: str
    shard: int
    num_shards: int
    versions: _containers.ScalarMap[int, int]
    def __init__(self, layout_json: _Optional[str] = ..., run_id: _Optional[str] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., versions: _Optional[_Mapping[int, int]] = ...) -> None: ...

class ExportFragmentRequest(_message.Message):
    __slots__ = ("fragment",)
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    fragment: int
    def __init__(self, fragment: _Optional[int] = ...) -> None: ...
