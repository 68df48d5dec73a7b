"""Why a request was refused (or a call failed): one vocabulary for the synchronizer, its server, the
client and the island. Counted in Status, sent as the start of a gRPC status's details, asserted in
tests. Which gRPC status code carries each lives in the server only; :class:`SynchronizerError`,
how a refusal reaches an island whichever link carried it, lives here so that a link without gRPC
(synchronizer/local_link.py) raises the same exception as the gRPC client."""

from __future__ import annotations

import enum


class Reason(str, enum.Enum):
    # refusals by the synchronizer
    LAYOUT_MISMATCH = "layout_mismatch"
    UNKNOWN_FRAGMENT = "unknown_fragment"
    BAD_PAYLOAD = "bad_payload"
    NON_FINITE = "non_finite"
    BAD_COUNTERS = "bad_counters"
    BAD_SEQUENCE = "bad_sequence"
    BAD_ISLAND = "bad_island"
    UNKNOWN_CODEC = "unknown_codec"
    NOT_JOINED = "not_joined"
    NOT_SEEDED = "not_seeded"
    WRONG_SESSION = "wrong_session"
    OLD_SEQUENCE = "old_sequence"
    SEQUENCE_REUSED = "sequence_reused"
    BUSY = "busy"
    TOO_MANY_ISLANDS = "too_many_islands"
    NUM_ISLANDS_MISMATCH = "num_islands_mismatch"
    ISLAND_RUNNING = "island_running"
    UNAUTHENTICATED = "unauthenticated"
    # a contribution left out of a merge (counted with the refusals)
    NON_FINITE_STEP = "non_finite_step"
    # the client's own verdicts
    UNREACHABLE = "unreachable"
    SHARD_MISMATCH = "shard_mismatch"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, details: str) -> Reason:
        """The reason a status's details start with (``reason: message``), else UNKNOWN."""
        head = details.split(":", 1)[0].strip()
        try:
            return cls(head)
        except ValueError:
            return cls.UNKNOWN


REJOIN = (Reason.NOT_JOINED, Reason.WRONG_SESSION)  # answered by joining again, then retrying


class SynchronizerError(RuntimeError):
    """The synchronizer refused a request (``reason``), or could not be reached in time.

    ``code``: the gRPC status code that carried it (a ``grpc.StatusCode``), or None where no gRPC
    call did (a refusal through the in-process link, or the client's own verdict)."""

    def __init__(self, code: object | None, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.code, self.reason = code, reason
