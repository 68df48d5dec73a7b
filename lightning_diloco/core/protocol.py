"""The records the synchronizer and its islands exchange, each defined once.

The service returns them, the gRPC server turns them into messages and the client back into
the same records (transport/messages.py), and the island, the launcher, the status page and the
in-process test double read them: one record per concept on every side of the wire. The gRPC
messages (synchronizer.proto) have the same field names, converted field by field by name, so a
field added on one side only fails a test instead of going missing on the wire.

Keyword-only and frozen: built by name, never changed after. Islands and fragments are keyed by
int everywhere; only :meth:`SynchronizerStatus.to_dict` (JSON) turns keys into text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_diloco.core.codecs import Payload
    from lightning_diloco.core.config import RunConfig


RUNNING_WINDOW = 5.0
"""Seconds after an island's session was last heard from (a heartbeat comes every second) during
which a join as that island by another process is refused (``island_running``): two processes
with one island index used to take the session from each other on every call. A client retries
that refusal for up to :data:`RUNNING_PATIENCE` seconds, so an island restarted after a crash gets
in once its old process has been silent this long."""
RUNNING_PATIENCE = 3 * RUNNING_WINDOW


# ---- joining and liveness ---------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class JoinInfo:
    """What an island learns when it joins (from every shard, combined by the client)."""

    config: RunConfig
    """The run's settings: the synchronizer's are authoritative."""
    layout_hash: str
    versions: dict[int, int]
    """Fragment -> its current version; -1 for a fragment not seeded yet."""
    run_step: int
    """The run's clock: the schedule step a joining island starts at."""
    session: str = ""
    """Names this join (per shard): requests of an older session are refused."""
    incarnation: str = ""
    """Which synchronizer process answered; a new one after a restart."""


@dataclass(kw_only=True, frozen=True)
class Beat:
    """The answer to a heartbeat."""

    versions: dict[int, int]
    run_step: int


# ---- contributions and what comes back -----------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class Contribution:
    """One push: an island's progress on a fragment since ``base_version``, encoded by ``codec``.

    Built once by the island's leader (learner/leader.py) and passed along as it is: through the
    link (either one), the wire (its fields but ``payload`` are the ``PushHeader``'s, converted by
    name in transport/messages.py), the service and its fragment's owner, which admits it and
    makes the round's entry of it (synchronizer/fragment.py)."""

    island: int
    fragment: int
    round: int
    """The round it was sent for: schedule step // H at the send."""
    base_version: int
    tokens: float
    steps: int
    codec: str
    seq: int
    layout_hash: str
    payload: Payload = b""
    """Encoded by ``codec``; empty in a header read off the wire before its payload."""
    session: str | None = None
    """The session its island's join issued, added by the link; None from an in-process caller
    that never joined through a link (trusted)."""


@dataclass(kw_only=True, frozen=True)
class PushAck:
    """What a push learns at once: where its contribution went."""

    fragment: int
    round: int
    """The round it will be merged in."""
    late: bool
    """Sent for a round that had already closed: merged into the next one."""
    duplicate: bool
    """A retry of a contribution already accepted: nothing was added."""
    version: int
    """The fragment's version when it was accepted."""


@dataclass(kw_only=True, frozen=True)
class RoundRequest:
    """The synchronizer asks an island to send ``fragment`` now, for ``round``."""

    fragment: int
    round: int
    due_step: int
    """Where ``round`` is on the run's clock: an island behind it skips ahead."""


@dataclass(kw_only=True, frozen=True)
class VersionUpdate:
    """A new global version of a fragment for one island: a delta against the version it last got
    (``base_version``), or the full fp32 value when ``base_version`` is -1. Made by the fragment's
    state (what each version costs, encoded once for every island), completed per island by its
    rounds, and passed as it is to the island's inbox (its fields but ``payload`` are the wire's
    ``FragmentHeader``, converted by name)."""

    fragment: int
    version: int
    base_version: int
    """The version the island holds (or the one just before, in a chain of steps); -1: sent whole."""
    codec: str
    payload: Payload
    """Encoded by ``codec``: a uint8 tensor where it is made (core/state.py, core/downlink.py),
    the bytes off the wire."""
    round: int = -1
    """The round that produced this version (-1: none known, e.g. the seed); the synchronizer's
    rounds fill it in for the island (synchronizer/rounds.py)."""
    included: bool = False
    """Whether a contribution of this island was merged since its ``base_version`` (filled in
    per island, as ``round``)."""


# ---- status ---------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class IslandStatus:
    live: bool
    world_size: int
    steps: int
    """Local steps the island reported in its last heartbeat (they restart at 0 with the process)."""
    schedule_step: int
    """Where the island is on the run's clock."""
    step_time_s: float
    accepted: int
    """Contributions of this island merged into a global version."""
    seen_s_ago: float
    merged_s_ago: float | None = None
    """None: none of its contributions has been merged yet."""
    left: bool = False
    """It left the run (ended its training, or was stopped) and has not joined since."""


@dataclass(kw_only=True, frozen=True)
class LastClose:
    """How a fragment's latest round closed."""

    round: int
    version: int
    contributors: int
    late: int
    clipped: int
    dropped: int
    grace_wait_s: float
    reason: str


@dataclass(kw_only=True, frozen=True)
class RoundStatus:
    """One fragment's open round and the totals over every round it closed."""

    round: int
    open: bool
    open_contributors: int
    waiting_late: int
    """Entries in the open round that were sent for an earlier one."""
    closed: int
    merged_entries: int
    merged_late: int
    superseded: int
    clipped: int
    dropped: int
    grace_wait_total_s: float
    grace_wait_max_s: float
    last: LastClose | None = None
    """None until the fragment's first round closes."""


@dataclass(kw_only=True, frozen=True)
class SynchronizerStatus:
    """One shard of the synchronizer."""

    shard: int
    num_shards: int
    incarnation: str
    layout_hash: str
    """Empty until the first island joins."""
    outer_steps: int
    """Outer steps taken; a fragment recovering after a restart counts the version it waits to get
    back (its ``versions`` entry is -1 until then), so only a lost version makes it go back."""
    run_step: int
    sync_every: int
    num_fragments: int
    min_quorum: int
    bytes_in: int
    bytes_out: int
    checkpoint_failures: int
    last_checkpoint_error: str
    last_checkpoint_outer_steps: int
    versions: dict[int, int] = field(default_factory=dict)
    """Fragment -> its current global version."""
    live_islands: list[int] = field(default_factory=list)
    islands: dict[int, IslandStatus] = field(default_factory=dict)
    rounds: dict[int, RoundStatus] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    """Contributions by outcome (on_time, late, duplicate, merged, ...)."""
    refused: dict[str, int] = field(default_factory=dict)
    """Refusals by :class:`~lightning_diloco.reasons.Reason` value."""
    adjustments: list[str] = field(default_factory=list)
    """Settings changed to fit the run, as said in the log."""

    def to_dict(self) -> dict:
        """Plain JSON-ready data (``/status.json``, ``lightning-diloco status --json``, recipe summaries)."""
        return asdict(self)
