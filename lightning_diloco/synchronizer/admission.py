"""Admission of the numbers a client sends: each is checked against the run before it can reach
state that later replies, Status or a checkpoint carry.

Why it matters (issue 21): a push naming round 2**61 used to become the fragment's next round, so
the run's step (round x H) no longer fit the int64 of every later Join, Heartbeat and Status reply,
and the checkpoint carried it into every restart. The rule: a number that sizes, orders or places
anything is bounded by what the run itself makes plausible, not only by its sign.

- Rounds: a send may name a round up to ``lead_steps`` ahead of the run's clock (core of the
  schedule: islands in phase are within a round of each other), or the fragment's next round if
  that is later (the run after a restart). A send for a round further ahead is taken for the
  latest admitted one: its work is kept, and it cannot open a round the run has not reached.
- Counters (tokens, steps) and sequence numbers: requests.py; schedule steps and step times:
  membership.py (a robust clock and a rate bound); wait times: server.py.
"""

from __future__ import annotations

from lightning_diloco.core.schedule import latest_round

MAX_WORLD_SIZE = 1 << 20  # processes per island: past this it is not a world size


def admitted_round(sent_for: int, *, next_round: int, clock_step: int, lead_steps: int, offset: int, sync_every: int) -> int:
    """The round a send for ``sent_for`` is taken for: itself, or the latest round the run admits."""
    ceiling = max(0, next_round, latest_round(clock_step + lead_steps, offset, sync_every))
    return min(sent_for, ceiling)


def join_problem(island: int, world_size: int) -> str | None:
    if island < 0 or not 1 <= world_size <= MAX_WORLD_SIZE:
        return f"island={island} world_size={world_size}: need island >= 0 and 1 <= world_size <= {MAX_WORLD_SIZE}"
    return None
