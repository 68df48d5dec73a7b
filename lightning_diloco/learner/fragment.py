"""One fragment of the model on an island, and its one owner: :class:`IslandFragment`.

Its global value (``base``) and version, the island's progress since, its send in flight
(:class:`Flight`) and the global version taken to be applied (``pending``) live here, changed on
the training thread at step boundaries, identically on every rank: the leader decides
(:meth:`~lightning_diloco.learner.island.IslandLearner._plan`), every rank carries the decision
out. From send to apply: the plan finds the fragment due and not in flight; :meth:`~IslandFragment.send`
(every rank: snapshot; the leader pushes on its pool, leader.py); the ack comes back into the
flight's future and the version of its round into the leader's inbox (inbox.py); at a later step
boundary the plan takes that version once :meth:`~IslandFragment.may_take` allows and
:meth:`~IslandFragment.take` decides the :class:`Apply`; :meth:`~IslandFragment.apply` (every
rank) takes it into the parameters with the apply rule and ends the flight.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from lightning_diloco.core.apply import keeps_counters
from lightning_diloco.core.config import ScheduleConfig
from lightning_diloco.core.feedback import UplinkFeedback
from lightning_diloco.core.outer import island_delta
from lightning_diloco.core.protocol import PushAck
from lightning_diloco.learner.clock import Clock
from lightning_diloco.learner.inbox import Arrival, Inbox
from lightning_diloco.learner.leader import LeaderSync
from lightning_diloco.learner.shards import IslandShards
from lightning_diloco.learner.staging import HostCopy


@dataclass(kw_only=True)
class Flight:
    """A contribution sent and not yet answered by its round's global version."""

    round: int
    """The round it was sent for. The synchronizer may merge it into another one (an open round
    it joins, or the next one when it came late): the ack says which."""
    apply_at: int
    snapshot: torch.Tensor | None  # kept for apply='rebase'
    tokens_at_send: float
    steps_at_send: int
    sent_at: float
    future: Future[PushAck] | None  # leader only: the push's ack

    def failure(self) -> BaseException | None:
        """Why the push failed, once its answer is back (None: acked, or not answered yet)."""
        return self.future.exception() if self.future is not None and self.future.done() else None

    def ack(self) -> PushAck | None:
        """The push's ack, once back (None before, or on failure): its ``round`` is the one the
        synchronizer merged the contribution in."""
        if self.future is None or not self.future.done() or self.future.exception() is not None:
            return None
        return self.future.result()

    def ended_by(self, arrival: Arrival) -> bool:
        """Whether ``arrival`` is the version of (or after) the round holding this contribution."""
        ack = self.ack()
        return ack is not None and arrival.round >= ack.round

    def answered(self) -> bool:
        """The push's ack (or refusal) is back, so whether a version ends this flight can be told."""
        return self.future is None or self.future.done()

    def late(self) -> bool:
        """Acked as late: it waits in the fragment's next round, which opens on the next send."""
        ack = self.ack()
        return ack is not None and ack.late

    def replaced_by(self, r: int) -> bool:
        """A send for round ``r`` replaces this one, acked late: that one waits in the round of
        its ack, which opens only when some island sends for it, and this send (for it or a later
        one) may be that send; its entry replaces the late one (one per island), carrying the older
        one's progress as far as the apply rule kept it. Held back instead, an island whose sends
        were all late (behind rounds opened by islands since gone) sent nothing for a push wait."""
        ack = self.ack()
        return ack is not None and ack.late and r >= ack.round


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
    exact: bool
    """Whether the island's copy is the published value after it (:attr:`Arrival.exact`)."""
    residual: bool = False
    """The leader shares one more tensor after the steps: what its push could not carry, which every
    rank adds to its parameters (``uplink_residual="parameters"``, core/feedback.py)."""


class IslandFragment:
    """Fragment ``number`` on this rank of the island: this rank's part of its global value and
    of the snapshots, the island's tokens and steps since, its send in flight (never two at once)."""

    def __init__(self, number: int, shards: IslandShards, schedule: ScheduleConfig, base: torch.Tensor) -> None:
        self.number, self.shards, self.schedule = number, shards, schedule
        self.base = base  # the global value last applied (flat): the next outer gradient is measured from it
        self.version = 0  # the global version base is; -1: none yet (its shard was away when the island joined)
        self.exact = True
        """``base`` is, as far as the island can tell, the published value of ``version`` bit for bit
        (False: it took summed steps, inbox.py): what a restarted synchronizer could take back."""
        self.sent_round = -1  # the latest round it was sent for; -1: none
        self.tokens, self.steps = 0.0, 0  # the island's progress not yet counted by a merged send: the next send's weight
        self.flight: Flight | None = None
        self.pending: Arrival | None = None
        """Leader: the arrival taken to be applied at this step boundary (the inbox's newest may be
        a later version by then: applied next)."""
        self.pending_residual: torch.Tensor | None = None
        """Leader: the residual taken with ``pending`` (:meth:`take`), shared with the ranks at its apply."""

    def stepped(self, tokens: float) -> None:
        self.tokens += tokens
        self.steps += 1

    def adopt(self, value: torch.Tensor, version: int) -> None:
        """Start over from the global ``value``: nothing of this island's progress is in it."""
        self.base, self.version, self.exact = value, version, True
        self.tokens, self.steps = 0.0, 0

    def may_give_back(self) -> bool:
        """Whether ``base`` may be a global version a restarted synchronizer waits for: it holds
        one, and no summed steps took it off the published value."""
        return self.version >= 0 and self.exact

    def held(self) -> tuple[int, torch.Tensor] | None:
        """(version, value) of the global fragment as the leader holds it whole, to be given back
        (None: nothing to give, or sharded: :meth:`gather_held` at a step boundary instead).
        Read from the heartbeat thread: ``base`` is replaced, never changed in place, and a torn
        pair's digest does not match the synchronizer's log."""
        if self.shards.any_sharded(self.number) or not self.may_give_back():
            return None
        return self.version, self.base

    def gather_held(self) -> tuple[int, torch.Tensor] | None:
        """(Every rank, at a step boundary: a collective of the whole fragment.) (version, whole
        value) of the global fragment whose parts the ranks hold in ``base``, on the leader (None
        elsewhere): bit for bit the parts, so what a whole copy of the same version would be."""
        whole = self.shards.gather(self.number, self.base)
        return None if whole is None else (self.version, whole)

    # ---- the send -----------------------------------------------------------------------------

    def send(self, round: int, *, apply_at: int, clock: Clock, leader: LeaderSync | None, seq: int,
             inbox: Inbox | None) -> None:
        """Send its progress since ``base`` for ``round`` (every rank: sharded parts are gathered;
        the leader pushes on its pool, and a push that fails wakes whoever waits on the inbox: it
        settles the flight too). ``apply_at``: the step from which its round's version is applied."""
        p = self.number
        rebase, sharded = self.schedule.apply == "rebase", self.shards.any_sharded(p)
        snapshot: torch.Tensor | None = None
        local: torch.Tensor | HostCopy | None = None
        base: torch.Tensor | None = None
        if leader is not None or sharded or rebase:  # a whole non-sharded fragment is sent from the leader's copy alone
            staged = self.shards.snapshot(p)  # host copy of this rank's part, 1/P of the model (on CUDA, still copying)
            if sharded or rebase:
                # sharded: every rank's part of the outer gradient is gathered whole on the leader (a
                # collective, so here); rebase: its apply changes the kept snapshot in place, so the
                # outer gradient is taken from it now: both wait for the copy
                snapshot = staged.wait()
                local = self.shards.gather(p, island_delta(snapshot, self.base))
            else:  # the push thread forms the outer gradient (once the copy is done): the snapshot is the push's alone, the base is never changed
                local, base = staged, self.base
        future = None
        if leader is not None:
            assert local is not None, "the leader holds the whole outer gradient (IslandShards.gather)"
            assert inbox is not None, "the leader's inbox opens at start(), before any step"
            future = leader.push(fragment=p, round=round, local=local, base=base, base_version=self.version,
                                 tokens=self.tokens, steps=self.steps, seq=seq)
            future.add_done_callback(lambda _: inbox.poke())
        self.flight = Flight(round=round, apply_at=apply_at, snapshot=snapshot if rebase else None,
                             tokens_at_send=self.tokens, steps_at_send=self.steps, sent_at=clock.now(), future=future)
        self.sent_round = round

    def blocks_send(self, r: int) -> bool:
        """Its flight keeps a send for round ``r`` back (never two sends of one fragment in flight)."""
        return self.flight is not None and not self.flight.replaced_by(r)

    # ---- the arrival (the leader's decisions) -------------------------------------------------

    def may_take(self, step: int) -> bool:
        """Whether its newest arrival may be applied at ``step``: no flight, or ``overlap_steps``
        since the send and its ack back (a version come before the ack could not end the flight,
        which then waited for the next round's and skipped the send for it: a test hung, 2026-11-28)."""
        return self.flight is None or (step >= self.flight.apply_at and self.flight.answered())

    def ended_by(self, arrival: Arrival) -> bool:
        return self.flight is not None and self.flight.ended_by(arrival)

    def late(self) -> bool:
        """Its send was acked late: it waits for a round that opens only when some island sends
        for it, so no wait of this island's is for it."""
        return self.flight is not None and self.flight.late()

    def settled(self, inbox: Inbox) -> bool:
        """(Under the inbox's lock.) Its send is answered: the version of its round arrived, or its
        push failed (no send: settled)."""
        fresh = inbox.fresh.get(self.number)
        return self.flight is None or (fresh is not None and self.flight.ended_by(fresh)) or self.flight.failure() is not None

    def awaited(self, inbox: Inbox) -> bool:
        """(Under the inbox's lock.) Worth a wait: sent, neither settled nor late."""
        return not self.late() and not self.settled(inbox)

    def take(self, arrival: Arrival, feedback: UplinkFeedback | None = None) -> Apply:
        """Decide to apply ``arrival``, kept as ``pending`` until applied. ``feedback``: the
        leader's uplink feedback where residuals live in the parameters (``uplink_residual``): the
        residual of the push this arrival answers goes into the parameters with it."""
        self.pending = arrival
        ends = self.ended_by(arrival)
        self.pending_residual = feedback.take(self.number) if feedback is not None and ends else None
        return Apply(fragment=self.number, version=arrival.version, base_version=arrival.base_version,
                     steps=len(arrival.steps), ends_flight=ends, included=arrival.included,
                     exact=arrival.exact, residual=self.pending_residual is not None)

    # ---- the apply (every rank) ---------------------------------------------------------------

    def apply(self, a: Apply) -> int:
        """Take the global version ``a`` into this rank's part of the parameters with the run's
        apply rule; returns its staleness (versions skipped since the one held)."""
        p, mode, sched = self.number, self.schedule.apply, self.schedule
        if self.shards.leader:
            assert self.pending is not None, "the leader's plan took the arrival of every Apply it broadcast"
            steps: tuple[torch.Tensor | None, ...] = self.pending.steps
        else:
            steps = (None,) * a.steps
        self.pending = None
        if a.base_version >= 0:  # deltas from the version this island holds: onto each rank's own part
            # one at a time, in the synchronizer's order (published + step): its published value bit for bit
            value = self.base + self.shards.scatter(p, steps[0])
            for step in steps[1:]:
                value.add_(self.shards.scatter(p, step))
        else:
            value = self.shards.scatter(p, steps[0])
        residual = None
        if a.residual:  # (every rank, as it took the steps) the leader's residual, this rank's part
            residual = self.shards.scatter(p, self.pending_residual if self.shards.leader else None)
        self.pending_residual = None
        if a.base_version < 0 and a.version == self.version:
            staleness = self._correct(value)
            self._keep(residual)
            return staleness
        snapshot = self.flight.snapshot if self.flight is not None and a.ends_flight else None
        # kappa applies to the progress since a merged send; progress on an older version is all unmerged
        self.shards.apply(p, mode, value, self.base if snapshot is None else snapshot, alpha=sched.mix_alpha,
                          keep=1.0 if snapshot is None else sched.rebase_keep)
        self._keep(residual)
        flight = self.flight
        if keeps_counters(mode):
            if a.ends_flight and flight is not None:  # what the send counted is in the global model now
                self.tokens -= flight.tokens_at_send
                self.steps -= flight.steps_at_send
            elif flight is not None and flight.snapshot is not None:  # the flight's progress moved with us
                flight.snapshot.add_(value).sub_(self.base)
        else:
            self.tokens, self.steps = 0.0, 0
        staleness = max(0, a.version - self.version - 1) if self.version >= 0 else 0  # -1: never had one
        self.base, self.version = value, a.version
        self.exact = a.base_version < 0 or (self.exact and a.exact)  # a whole value is the published one
        if a.ends_flight:
            self.flight = None
        return staleness

    def _keep(self, residual: torch.Tensor | None) -> None:
        """Add ``residual`` (this rank's part of what the push could not carry) to the parameters:
        the progress since ``base`` then includes it, and the next push carries it once."""
        if residual is not None:
            self.shards.add(self.number, residual)

    def _correct(self, value: torch.Tensor) -> int:
        """Take ``value``, the version the island holds, sent whole (pulled after its inbox summed
        steps, inbox.py): already applied once with the apply rule, it only replaces ``base`` (a
        second mix would pull the parameters to it again, an overwrite would drop the progress
        since): the parameters, and a kept snapshot, move by the base's rounding error, the
        progress since and the counters stay, the flight is not ended. Returns the staleness, 0."""
        self.shards.apply(self.number, "rebase", value, self.base, alpha=0.0, keep=1.0)
        if self.flight is not None and self.flight.snapshot is not None:
            self.flight.snapshot.add_(value).sub_(self.base)
        self.base, self.exact = value, True
        return 0


def fragments_state_dict(fragments: list[IslandFragment]) -> dict:
    """The fragments' part of an island's checkpoint: one list per field (flights are not saved:
    a resumed island sends again)."""
    return {
        "versions": [f.version for f in fragments],
        "bases": [f.base.clone() for f in fragments],
        "sent_round": [f.sent_round for f in fragments],
        "tokens": [f.tokens for f in fragments],
        "steps": [f.steps for f in fragments],
        "exact": [f.exact for f in fragments],
    }


def load_fragments(fragments: list[IslandFragment], state: dict) -> None:
    """Put a checkpoint's fragments (:func:`fragments_state_dict`) in place; no send is in flight."""
    fields = zip(fragments, state["bases"], state["versions"], state["sent_round"], state["tokens"], state["steps"],
                 strict=True)
    for f, base, version, sent_round, tokens, steps in fields:
        f.base, f.version, f.sent_round = base.clone(), int(version), int(sent_round)
        f.tokens, f.steps, f.flight, f.pending = float(tokens), int(steps), None, None
    for f, exact in zip(fragments, state.get("exact", [True] * len(fragments)), strict=True):  # absent before 2026-11-28
        f.exact = bool(exact)
