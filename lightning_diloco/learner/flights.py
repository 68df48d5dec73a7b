"""The island's records between a send and the step at which its round's global fragment is
applied: a send in flight, a decision to apply a version, and the leader's plans that every rank
of the island carries out (broadcast, so all ranks change the same fragments at the same step)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from lightning_diloco.learner.inbox import Arrival


@dataclass(kw_only=True)
class Flight:
    """A contribution sent and not yet answered by its round's global version."""

    fragment: int
    round: int
    """The round it was sent for. The synchronizer may merge it into another one (an open round
    it joins, or the next one when it came late): the ack says which."""
    apply_at: int
    snapshot: torch.Tensor | None  # kept for apply='rebase'
    tokens_at_send: float
    steps_at_send: int
    sent_at: float
    future: Future | None  # leader only: the push's ack

    def merged_in(self) -> int | None:
        """The round the synchronizer put it in, once the ack is back (None before, or on failure)."""
        if self.future is None or not self.future.done() or self.future.exception() is not None:
            return None
        return self.future.result().round

    def ended_by(self, arrival: Arrival) -> bool:
        """Whether ``arrival`` is the version of (or after) the round holding this contribution."""
        merged_in = self.merged_in()
        return merged_in is not None and arrival.round >= merged_in

    def answered(self) -> bool:
        """The push's ack (or refusal) is back, so whether a version ends this flight can be told."""
        return self.future is None or self.future.done()

    def failed(self) -> bool:
        return self.future is not None and self.future.done() and self.future.exception() is not None

    def late(self) -> bool:
        """Acked as late: it waits in the fragment's next round, which opens on the next send."""
        return self.merged_in() is not None and self.future.result().late


@dataclass(kw_only=True, frozen=True)
class Apply:
    """Apply ``version`` of ``fragment`` at this step; decided by the leader, broadcast to all."""

    fragment: int
    version: int
    base_version: int
    """-1: the leader's value is the whole fragment; else the change from this version (the one held)."""
    steps: int
    """How many tensors the leader shares (:attr:`Arrival.steps`): the other ranks take as many."""
    ends_flight: bool
    included: bool


@dataclass(kw_only=True, frozen=True)
class StartPlan:
    """How the island starts from the global model."""

    pull: list[int]
    """Fragments whose global value is pulled (it replaces ours unless a resumed checkpoint holds its version)."""
    absent: list[int]
    """Fragments of shards that did not answer: they keep their local values until a version arrives."""
    schedule_step: int


@dataclass(kw_only=True, frozen=True)
class StepPlan:
    """What the island does at one step boundary."""

    schedule_step: int
    fail: list[int] = field(default_factory=list)
    """Fragments whose send failed: their flight ends without a version."""
    send: list[tuple[int, int]] = field(default_factory=list)
    """(fragment, round) to send now."""
    apply: list[Apply] = field(default_factory=list)
