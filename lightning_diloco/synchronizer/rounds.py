"""One fragment's rounds: collect contributions, decide, close into one outer step, publish.

Round r of fragment p collects the contributions sent for it (*on time*) and those sent for an
earlier round that arrived after it closed (*late*: they go into the next round, never into an
extra one). A round opens (is due) when its first on-time contribution arrives, closes once
(quorum, then the grace window; see core/quorum.py) and produces at most one outer step, at any
quorum. Rounds nobody sent for are skipped: they produce no step.

Every contribution is measured against its own base (core/state.py says why) and a late one is
discounted by its age, so it adds its island's progress and never undoes other islands' work. The
merge never needs the base's value, only its age, so no base is refused for being old: an island
that was away contributes what it did, weighed down by how far behind it was.
An island has at most one entry in a round, on time or late: a newer one replaces it (its newer
work, measured from a base that never held the older, contains it), so one island is one vote
however many pushes it makes.

All methods take ``now`` (monotonic seconds) from the caller, and the fragment's state (the
value a round steps), which the fragment's owner holds (fragment.py), as its lock; the object
holds no clock, no state of the fragment and no lock.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, replace

import torch

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.fragments import TensorSpec, split_fragment
from lightning_diloco.core.guard import InfluenceGuard, opposition_scale
from lightning_diloco.core.merge import merge_outer_gradients, norm64
from lightning_diloco.core.protocol import LastClose, PushAck, RoundStatus, VersionUpdate
from lightning_diloco.core.quorum import Decision, RoundView, decide, slack_steps
from lightning_diloco.core.state import FragmentState

log = logging.getLogger(__name__)

PEER_WAIT_S = 10.0
"""Seconds an entry alone in a fragment's round, before any other island's was merged, waits for
another live island's while no island has said its step time (after that: H step times)."""
MAX_WAITING = 1024  # entries one round holds (one per island): past this a new island's push is refused busy


class RoundFull(RuntimeError):
    """The round already holds ``MAX_WAITING`` entries; a new island's waits for the next."""


class SequenceError(ValueError):
    """A contribution older than one this island already had merged or waiting (``reused``: its
    sequence number came before with another payload)."""

    def __init__(self, message: str, reused: bool = False) -> None:
        super().__init__(message)
        self.reused = reused


@dataclass(kw_only=True)
class Entry:
    """One contribution waiting in a round."""

    island: int
    seq: int
    sent_for: int
    base_version: int
    outer_gradient: torch.Tensor
    tokens: float
    steps: int
    norm: float
    digest: bytes = b""
    """Of the payload: a retry must carry the very same bytes."""
    session: str = ""
    """The island's session it came in (sequence numbers are ordered within one)."""


@dataclass(kw_only=True, frozen=True)
class ClosedRound:
    fragment: int
    round: int
    version: int
    islands: tuple[int, ...]
    late: int
    """Entries merged that were sent for an earlier round."""
    clipped: int
    """Entries whose outer gradient was scaled down to the norm bound (core/guard.py)."""
    dropped: int
    """Entries left out because the step with them was not finite."""
    grace_wait_s: float
    """Seconds from quorum to close."""
    reason: str
    closed_at: float
    step_scale: float = 1.0
    """The factor the step budget scaled the fragment's movement by (core/step_budget.py; 1.0: untouched)."""
    opposed: float = 1.0
    """The factor the step was shortened by because its entries opposed each other (core/guard.py opposition_scale)."""

    def summary(self) -> LastClose:
        return LastClose(round=self.round, version=self.version, contributors=len(self.islands), late=self.late,
                         clipped=self.clipped, dropped=self.dropped, grace_wait_s=self.grace_wait_s, reason=self.reason)


@dataclass(kw_only=True, frozen=True)
class _Settled:
    seq: int
    round: int
    digest: bytes
    session: str


@dataclass
class RoundTotals:
    closed: int = 0
    entries: int = 0
    late: int = 0
    superseded: int = 0
    clipped: int = 0
    dropped: int = 0
    grace_wait_s: float = 0.0
    grace_wait_max_s: float = 0.0


def each_part(closed: ClosedRound, parts: Sequence[tuple[str, Callable[[], object]]]) -> list[str]:
    """Run every part of what a closed round changes after its outer step, each even if one
    before it failed, and log each failure once, naming the part. Returns the names that failed.

    The step is taken and the round marked closed before any part runs, and no part is run
    again: a part that failed stays short (its counter, its credit) rather than risk a second
    step or a part applied twice; the log says which, and the round's other effects are whole.
    """
    failed = []
    for name, part in parts:
        try:
            part()
        except Exception:  # noqa: BLE001 - one part's failure must not skip the others
            failed.append(name)
            log.exception("fragment %d round %d closed into version %d, but its %s failed and stays short; "
                          "the round's other effects were applied", closed.fragment, closed.round, closed.version, name)
    return failed


def _retry(entry: Entry, seq: int, digest: bytes) -> bool:
    """``entry`` resends the contribution of sequence number ``seq`` and payload ``digest``."""
    return entry.seq == seq and entry.digest == digest


def round_index(frag: FragmentState | None) -> int:
    """The round of a fragment in state ``frag`` collecting contributions now (-1 before the
    first send, or unseeded)."""
    return frag.next_round if frag is not None else -1


class FragmentRounds:
    """The rounds of one fragment. Every method must be called with the fragment's lock held
    (fragment.py), and ``frag`` is the fragment's state as it holds it."""

    def __init__(self, fragment: int, specs: Sequence[TensorSpec], config: RunConfig) -> None:
        self.fragment, self.specs, self.config = fragment, list(specs), config
        self.opened_at: float | None = None
        self.opened_lead = 0
        """Steps the round's due step was ahead of the run's clock when it opened."""
        self.quorum_at: float | None = None
        self.entries: dict[int, Entry] = {}  # island -> its one waiting entry
        self.settled: dict[int, _Settled] = {}  # island -> its last merged contribution
        self.merged_in: dict[int, int] = {}  # island -> last version that merged a contribution of it
        self.rounds_of: dict[int, int] = {}  # version -> the round that produced it
        self.last: ClosedRound | None = None
        self.totals = RoundTotals()
        merge = config.merge
        self.guard = InfluenceGuard(merge.outlier_z, merge.outlier_window, config.schedule.sync_every)

    # ---- the round now collecting ------------------------------------------------------------

    def islands(self) -> set[int]:
        return set(self.entries)

    def add(self, frag: FragmentState, entry: Entry, now: float, clock_round: int = -1,
            lead_steps: int = 0) -> tuple[PushAck, bool]:
        """Put a validated contribution into the round it belongs to; returns the push's answer
        and whether this contribution made its round due (the other islands are asked to send).

        ``clock_round``: the round of this fragment that is due on the run's clock. A contribution
        sent for an earlier one is late even if no round closed since (e.g. retried across a
        synchronizer restart): only a send for a current round opens one.

        ``lead_steps``: how far the round's due step is ahead of the run's clock now; kept when
        this contribution opens the round, whose grace window then counts from the due step.

        Sequence numbers order one session's contributions: a rejoin (a new session) starts
        afresh, so a client that once held the island's session cannot lock its later sessions
        out with a huge number. A retry (the sequence number and payload of the island's waiting
        or last merged contribution) is answered as one whatever its session: a client resends a
        push whose answer it lost with the session it holds then, a new one if it rejoined
        meanwhile (a restart noticed by its heartbeat), and that used to merge the contribution a
        second time. One entry per island waits in a round: a newer one replaces it.
        """
        island = entry.island
        settled = self.settled.get(island)
        if settled is not None and (_retry(entry, settled.seq, settled.digest) or
                                    (settled.session == entry.session and entry.seq <= settled.seq)):
            if entry.seq == settled.seq:
                self._same_payload(entry, settled.digest)
                return PushAck(fragment=self.fragment, round=settled.round, late=False, duplicate=True,
                               version=frag.version), False
            raise SequenceError(f"sequence {entry.seq} of island {island} is older than its last merged one ({settled.seq})")
        waiting = self.entries.get(island)
        if waiting is not None and (_retry(entry, waiting.seq, waiting.digest) or
                                    (waiting.session == entry.session and entry.seq <= waiting.seq)):
            if entry.seq == waiting.seq:
                self._same_payload(entry, waiting.digest)
                return PushAck(fragment=self.fragment, round=frag.next_round, late=waiting.sent_for < frag.next_round,
                               duplicate=True, version=frag.version), False
            raise SequenceError(f"sequence {entry.seq} of island {island} is older than one already waiting ({waiting.seq})")
        if waiting is None and len(self.entries) >= MAX_WAITING:
            raise RoundFull(f"round {frag.next_round} of fragment {self.fragment} already holds {MAX_WAITING} islands' entries")
        if frag.next_round < 0:
            frag.next_round = entry.sent_for  # a fresh run: the first send names the round
        on_time = entry.sent_for >= max(frag.next_round, clock_round)
        opened = False
        if on_time and self.opened_at is None:
            if entry.sent_for > frag.next_round:
                frag.next_round = entry.sent_for  # nobody sent for the rounds in between
            self.opened_at, opened = now, True
            self.opened_lead = max(0, lead_steps)
        if waiting is not None:  # its island's newer work (late or not, from this session or a newer one) replaces it
            self.totals.superseded += 1
        self.entries[island] = entry
        if self.opened_at is not None and self.quorum_at is None and len(self.entries) >= self.config.merge.min_quorum:
            self.quorum_at = now
        return PushAck(fragment=self.fragment, round=frag.next_round, late=not on_time, duplicate=False,
                       version=frag.version), opened

    @staticmethod
    def _same_payload(entry: Entry, digest: bytes) -> None:
        if entry.digest != digest:
            raise SequenceError(f"sequence {entry.seq} of island {entry.island} came before with another payload; "
                                "a retry must resend the same bytes, new work needs a new sequence number", reused=True)

    def decide(self, frag: FragmentState | None, now: float, live: Set[int], step_time: float, sync_time: float,
               quorum: int) -> Decision:
        """``quorum``: the contributors the round needs now (core/quorum.py ``quorum_in_run``: K,
        lowered while islands that left leave fewer than K in the run)."""
        index = round_index(frag)
        if frag is not None and self.opened_at is None and self.entries and live <= set(self.entries):
            # only late entries, and every island still in the run has one here: the islands that
            # would have sent on time have left. Only an on-time send opened a round, so a slow
            # starter (a compile warm-up) that ended alone had none of its work merged (0 of 8)
            self.opened_at, self.opened_lead = now, 0
        if frag is None or self.opened_at is None:
            return Decision(False, f"round {index} not due yet")
        if len(self.entries) == 1 and (live - set(self.entries)):
            (only,) = self.entries
            # an entry alone in a round before any other island's was merged has no peer to be
            # bounded by but z x the fragment's own norm: a hostile island that sent first moved
            # the model from 10 to 26 from its target before any honest send (arena seed 11,
            # 2026-11-27). The others were asked to send now and do within a step; it waits for
            # them up to the fragment's whole round (H step times; PEER_WAIT_S before any island
            # said its step time), so a live island that never sends holds an honest one's first
            # round no longer than that
            wait = self.config.schedule.sync_every * step_time if step_time > 0 else PEER_WAIT_S
            if not self.guard.knows_a_peer_of(only) and now < self.opened_at + wait:
                self.quorum_at = None
                return Decision(False, f"round {index}: island {only}'s contribution waits for another live "
                                       "island's, which bounds it (none merged yet)", self.opened_at + wait)
        if self.quorum_at is None and len(self.entries) >= quorum:
            self.quorum_at = now  # reached by islands leaving, not by a contribution
        merge = self.config.merge
        # a late entry counts toward the quorum but not as the round's own send: with quorum 1 and
        # islands in phase, the late entries of three islands plus one on-time send looked like
        # "every live island contributed", so the round closed before the others' sends and they
        # were late for the next one in turn (76% of contributions merged a round late, 2026-11-27)
        on_time = frozenset(i for i, e in self.entries.items() if e.sent_for >= index)
        view = RoundView(contributors=frozenset(self.islands()), on_time=on_time, live=frozenset(live), opened_at=self.opened_at,
                         quorum_at=self.quorum_at, lead_steps=self.opened_lead)
        sched = self.config.schedule
        slack = slack_steps(merge.grace_slack, overlap_steps=sched.overlap_steps, sync_every=sched.sync_every)
        return decide(view, now, min_quorum=quorum, gamma=merge.grace_gamma, slack_steps=slack, step_time=step_time,
                      sync_time=sync_time)

    def close(self, frag: FragmentState, now: float, reason: str, taking_part: int | None = None) -> ClosedRound:
        """Merge every entry into one outer step and publish the new version. ``taking_part``: the
        islands live or in the round (the delayed Nesterov step's N; None: the round's own).

        Each entry is first bounded (core/guard.py: :meth:`InfluenceGuard.bound_round`). Should
        the step still not be finite, the entry with the longest outer gradient is left out and
        the rest merged again; a round whose entries are all left out closes without a step.

        A failure before the step leaves the round as it was, to be closed again. Once the step is
        taken the round is closed, and each part of its bookkeeping is applied once, whatever
        another part does (:func:`each_part`): no failure after the step raises.
        """
        assert self.entries, "only an open round with entries can close"
        index = frag.next_round
        entries = sorted(self.entries.values(), key=lambda e: (e.island, e.seq))
        # what a retry of each entry is answered with is made before the step and recorded with
        # it, not as a part after it: a settlement that failed there left no record, and the
        # push's retry was merged a second time
        settled = self._settle(entries, index)
        bounded = self.guard.bound_round(entries, fragment=frag.value, version=frag.version,
                                         staleness_discount=self.config.merge.staleness_discount)
        gradients, weights, clipped, shares = bounded.gradients, bounded.weights, bounded.clipped, bounded.shares
        version, step_norm, step_scale, opposed, share = None, 0.0, 1.0, 1.0, 1.0
        kept = list(range(len(entries)))
        while kept and version is None:
            step = torch.empty(frag.value.numel())
            merge_outer_gradients([split_fragment(gradients[i], self.specs) for i in kept],
                                  [weights[i] for i in kept], [s.role for s in self.specs], self.config.merge.method,
                                  out=split_fragment(step, self.specs))
            # the merged step's own bounds, in absolute terms (core/guard.py): the rules above hold
            # each entry to its peers, which a hostile half of the run can be. Entries that oppose
            # each other shorten an RDA step (which keeps its length however much they cancel; a
            # plain mean is short already: shortened again, two honest islands of different data
            # no longer merged as DiLoCo does, tests/simulate); the step budget bounds how far it
            # moves the fragment
            opposed = 1.0 if self.config.merge.method != "rda" else opposition_scale(
                [weights[i] for i in kept], [gradients[i] for i in kept], [norm64(gradients[i]) for i in kept])
            if opposed < 1.0:
                step.mul_(opposed)
            merged_islands = {entries[i].island for i in kept}
            moved: dict[str, float] = {}
            share = min(1.0, len(merged_islands) / max(taking_part or 0, len(merged_islands)))
            version = frag.apply(step, share=share,
                                 bound=functools.partial(self._within_step_budget, moved=moved, share=share))
            step_norm, step_scale = moved.get("length", 0.0), moved.get("scale", 1.0)
            if version is None:
                kept.remove(max(kept, key=lambda i: entries[i].norm))
        grace = max(0.0, now - self.quorum_at) if self.quorum_at is not None else 0.0
        # the round is closed from here on, whatever the bookkeeping below does: a closer that
        # looks again after an error (closers.py) must find no entries to merge a second time
        self.entries.clear()
        self.settled.update(settled)
        self.opened_at = self.quorum_at = None
        self.opened_lead = 0
        frag.next_round = index + 1
        dropped = len(entries) - len(kept)
        merged = [entries[i] for i in kept]
        islands = tuple(sorted({e.island for e in merged}))
        late = sum(e.sent_for < index for e in merged)
        self.last = ClosedRound(fragment=self.fragment, round=index, version=frag.version, islands=islands, late=late,
                                clipped=clipped, dropped=dropped, grace_wait_s=grace, reason=reason, closed_at=now,
                                step_scale=step_scale if version is not None else 1.0, opposed=opposed)
        # a step its entries' opposition shortened counts at the length they stated, in a round
        # of any size (StepBudget.record says why)
        each_part(self.last, [
            ("merged-in versions", lambda: self.merged_in.update({e.island: frag.version for e in merged})),
            ("influence guard's history", lambda: self._record(merged, shares)),
            ("step budget", lambda: self.guard.step_budget.record(step_norm * step_scale, scale=step_scale, opposed=opposed,
                                                                          share=share)
             if version is not None else None),
            ("versions' rounds", lambda: self._remember_round(frag, version, index)),
            ("round totals", lambda: self._count(len(merged), late, clipped, dropped, grace)),
        ])
        return self.last

    def _within_step_budget(self, length: float, moved: dict[str, float], share: float) -> float:
        """The factor the step budget allows a step that moves the fragment ``length`` for a round
        that merged ``share`` of the islands taking part; notes both in ``moved``."""
        moved["length"], moved["scale"] = length, self.guard.step_budget.scale(length, share)
        return moved["scale"]

    def _settle(self, entries: list[Entry], index: int) -> dict[int, _Settled]:
        """The islands' settled records once ``entries`` close round ``index`` (not applied here)."""
        updates = {}
        for e in entries:  # left out or not, each is settled: a retry gets the same answer
            settled = self.settled.get(e.island)
            if settled is None or settled.session != e.session or settled.seq < e.seq:
                updates[e.island] = _Settled(seq=e.seq, round=index, digest=e.digest, session=e.session)
        return updates

    def _record(self, merged: list[Entry], shares: dict[int, float]) -> None:
        for e in merged:
            self.guard.record(e.island, e.norm, e.tokens, e.steps)
        self.guard.record_round({e.island: shares[e.island] for e in merged})

    def _remember_round(self, frag: FragmentState, version: int | None, index: int) -> None:
        if version is not None:
            self.rounds_of[version] = index
        for old in [v for v in self.rounds_of if v <= frag.version - frag.depth]:  # no island is sent them again
            del self.rounds_of[old]

    def _count(self, merged: int, late: int, clipped: int, dropped: int, grace: float) -> None:
        t = self.totals
        t.closed, t.entries, t.late = t.closed + 1, t.entries + merged, t.late + late
        t.clipped, t.dropped = t.clipped + clipped, t.dropped + dropped
        t.grace_wait_s += grace
        t.grace_wait_max_s = max(t.grace_wait_max_s, grace)

    def publish(self, frag: FragmentState, island: int, have: int) -> list[VersionUpdate]:
        """What an island holding version ``have`` is sent to hold the current version, in order:
        deltas in the downlink codec (each encoded once, whatever the number of islands), or the
        value the islands hold, whole in fp32, when this fragment no longer keeps (or never
        issued) ``have`` (core/state.py, core/downlink.py)."""
        merged = self.merged_in.get(island, -1)
        updates = []
        for d in frag.downlink(self.fragment, have):
            since = have if d.base_version < 0 else d.base_version
            current = d.version == frag.version
            produced_by = self.rounds_of.get(d.version, max(-1, frag.next_round - 1) if current else -1)
            updates.append(replace(d, round=produced_by, included=since < merged <= d.version))
        return updates

    def memory(self) -> dict:
        """What the rounds remember beyond the fragment's state, for its checkpoint: the influence
        guard's votes and each island's settled contribution (so a retry of a push merged before
        a restart is still a retry after it, whatever session it comes with)."""
        return {"guard": self.guard.state_dict(),
                "settled": {i: {"seq": s.seq, "round": s.round, "digest": s.digest.hex(), "session": s.session}
                            for i, s in self.settled.items()}}

    def restore(self, memory: dict) -> None:
        """Take back :meth:`memory` from a checkpoint."""
        self.guard.load_state_dict(memory.get("guard", {}))
        self.settled = {int(i): _Settled(seq=int(s["seq"]), round=int(s["round"]), digest=bytes.fromhex(s["digest"]),
                                         session=str(s["session"])) for i, s in memory.get("settled", {}).items()}

    def status(self, frag: FragmentState | None) -> RoundStatus:
        t, index = self.totals, round_index(frag)
        return RoundStatus(
            round=index, open=self.opened_at is not None, open_contributors=len(self.islands()),
            waiting_late=sum(e.sent_for < index for e in self.entries.values()),
            closed=t.closed, merged_entries=t.entries, merged_late=t.late, superseded=t.superseded,
            clipped=t.clipped, dropped=t.dropped, grace_wait_total_s=t.grace_wait_s,
            grace_wait_max_s=t.grace_wait_max_s, last=self.last.summary() if self.last else None,
        )
