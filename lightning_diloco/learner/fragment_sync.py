"""One fragment's sync state on an island: its base, its version, the progress since, its send.

The island keeps one :class:`FragmentSync` per fragment and changes it only on the training
thread, at step boundaries, identically on every rank (the decisions are the leader's, broadcast).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_diloco.core.apply import keeps_counters
from lightning_diloco.learner.flights import Flight


@dataclass
class FragmentSync:
    base: torch.Tensor
    """The global value last applied (flat): the next outer gradient is measured from it."""
    version: int = 0
    """The global version ``base`` is; -1: none yet (its shard was away when the island joined)."""
    sent_round: int = -1
    """The latest round it was sent for; -1: none."""
    tokens: float = 0.0
    steps: int = 0
    """The island's tokens and inner steps not yet counted by a merged send: the next send's weight."""
    flight: Flight | None = None
    """Its send waiting for the version of its round, if any (never two at once)."""

    def stepped(self, tokens: float) -> None:
        self.tokens += tokens
        self.steps += 1

    def adopt(self, value: torch.Tensor, version: int) -> None:
        """Start over from the global ``value``: nothing of this island's progress is in it."""
        self.base, self.version = value, version
        self.tokens, self.steps = 0.0, 0

    def sent(self, flight: Flight) -> None:
        self.flight, self.sent_round = flight, flight.round

    def applied(self, value: torch.Tensor, version: int, mode: str, ends_flight: bool) -> int:
        """Bookkeeping after global ``version`` (``value``) was applied with ``mode``; returns its
        staleness (versions skipped since the one held)."""
        flight = self.flight
        if keeps_counters(mode):
            if ends_flight:  # what the send counted is in the global model now
                self.tokens -= flight.tokens_at_send
                self.steps -= flight.steps_at_send
            elif flight is not None and flight.snapshot is not None:  # the flight's progress moved with us
                flight.snapshot.add_(value).sub_(self.base)
        else:
            self.tokens, self.steps = 0.0, 0
        staleness = max(0, version - self.version - 1) if self.version >= 0 else 0  # -1: never had one
        self.base, self.version = value, version
        if ends_flight:
            self.flight = None
        return staleness


def fragments_state_dict(fragments: list[FragmentSync]) -> dict:
    """The fragments' part of an island's checkpoint: one list per field (flights are not saved:
    a resumed island sends again)."""
    return {
        "versions": [f.version for f in fragments],
        "bases": [f.base.clone() for f in fragments],
        "sent_round": [f.sent_round for f in fragments],
        "tokens": [f.tokens for f in fragments],
        "steps": [f.steps for f in fragments],
    }


def fragments_from_state_dict(state: dict) -> list[FragmentSync]:
    fields = zip(state["bases"], state["versions"], state["sent_round"], state["tokens"], state["steps"], strict=True)
    return [FragmentSync(base.clone(), int(version), int(sent_round), float(tokens), int(steps))
            for base, version, sent_round, tokens, steps in fields]
