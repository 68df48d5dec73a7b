"""Bounds on how far any one contribution can move a merge (docs/algorithm.md#bounds-on-one-contribution).

Two things decide a contribution's pull on a round: the norm of its outer gradient and its weight
(tokens x tokens per step). Each is bounded against a *reference* that one island cannot move:
the lower median of the values of the round's other contributions and of every island's own
recent values (each island one vote, the median of its last few). An island that inflates its
numbers round after round only ever moves its own vote, and a lower median of votes sits at or
below the honest ones, so the bound cannot be ratcheted up by a patient client.

- norm: an outer gradient longer than ``z`` x the reference is scaled down to that length
  (bounded, not refused: what it says is kept, only its size is limited). Before any history
  the fragment's own norm is the reference, so the bound works from the first round.
- weight: tokens per step above ``TOKENS_PER_STEP_FACTOR`` x the reference count as that, and
  steps above ``STEPS_FACTOR`` x H count as that.

A reference can be pushed *down* by an island reporting tiny values; it never falls below
``NORM_FLOOR`` of the fragment's norm, so such an island slows the others' steps at worst.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

TOKENS_PER_STEP_FACTOR = 4.0
STEPS_FACTOR = 4
NORM_FLOOR = 1e-3


def lower_median(values: Iterable[float]) -> float | None:
    ordered = sorted(v for v in values if math.isfinite(v))
    return ordered[(len(ordered) - 1) // 2] if ordered else None


class IslandVotes:
    """Each island's recent values of one quantity; its vote is their median."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.values: dict[int, deque[float]] = {}

    def record(self, island: int, value: float) -> None:
        if math.isfinite(value):
            self.values.setdefault(island, deque(maxlen=self.window)).append(value)

    def votes(self) -> list[float]:
        return [statistics.median(v) for v in self.values.values()]


@dataclass(frozen=True)
class Bounded:
    scale: float
    """Factor applied to the outer gradient (1.0: untouched)."""
    tokens: float
    steps: int

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


class InfluenceGuard:
    """One fragment's bounds. ``z`` = 0 turns the norm bound off (the weight bound stays)."""

    def __init__(self, z: float, window: int, sync_every: int) -> None:
        self.z, self.sync_every = z, sync_every
        self.norms = IslandVotes(window)
        self.tokens_per_step = IslandVotes(window)

    def bound(self, *, norm: float, tokens: float, steps: int, others: list[tuple[float, float]],
              fragment_norm: float, numel: int) -> Bounded:
        """``others``: (norm, tokens per step) of the round's contributions from other islands."""
        scale = 1.0
        if self.z > 0:
            reference = lower_median([*self.norms.votes(), *(n for n, _ in others)])
            if reference is None:  # the first round of this fragment: its own size is the yardstick
                reference = max(fragment_norm, math.sqrt(numel))
            reference = max(reference, NORM_FLOOR * fragment_norm)
            cap = self.z * reference
            if norm > cap:
                scale = cap / norm
        steps_cap = STEPS_FACTOR * self.sync_every
        bounded_steps = min(steps, steps_cap)
        tps = tokens / steps
        reference_tps = lower_median([*self.tokens_per_step.votes(), *(t for _, t in others)])
        if reference_tps is not None:
            tps = min(tps, TOKENS_PER_STEP_FACTOR * reference_tps)
        return Bounded(scale, tps * bounded_steps, bounded_steps)

    def record(self, island: int, norm: float, tokens: float, steps: int) -> None:
        """A merged contribution's raw values become its island's vote (clipped or not)."""
        self.norms.record(island, norm)
        self.tokens_per_step.record(island, tokens / steps)
