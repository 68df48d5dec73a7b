"""A fragment's send in flight, and a decision to apply a global version: the island's two
records between a send and the step at which its round's global fragment is applied."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from lightning_diloco.learner.inbox import Arrival


@dataclass
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

    def failed(self) -> bool:
        return self.future is not None and self.future.done() and self.future.exception() is not None

    def late(self) -> bool:
        """Acked as late: it waits in the fragment's next round, which opens on the next send."""
        return self.merged_in() is not None and self.future.result().late


@dataclass(frozen=True)
class Apply:
    """Apply ``version`` of ``fragment`` at this step; decided by the leader, broadcast to all."""

    fragment: int
    version: int
    ends_flight: bool
    included: bool
