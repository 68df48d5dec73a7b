"""What the synchronizer reports about itself: one typed record, read the same way in process
(the status page, the metrics, tests) and through gRPC (the launcher, ``lightning-diloco status``).

The gRPC message (``StatusReply`` in synchronizer.proto) has the same field names; the
transport converts one into the other field by field (transport/status.py), so a field added
here and not there fails a test instead of going missing on the wire. Islands and fragments are
keyed by int everywhere; only :meth:`SynchronizerStatus.to_dict` (JSON) turns keys into text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
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


@dataclass
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


@dataclass
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


@dataclass
class SynchronizerStatus:
    """One shard of the synchronizer."""

    shard: int
    num_shards: int
    incarnation: str
    layout_hash: str
    """Empty until the first island joins."""
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
