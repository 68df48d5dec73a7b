"""Bounds on how far any one contribution can move a merge (docs/algorithm.md#bounds-on-one-contribution).

Two things decide a contribution's pull on a round: the norm of its outer gradient and its weight
(tokens x tokens per step). Each is bounded against a *reference* that one island cannot move:
the lower median of the other islands' values, one per island: its contribution in the same
round where it has one (the same steps at the same point of training), else its vote, the median
of its last few. An island that inflates its numbers round after round only ever moves its own
value, and a lower median sits at or below the honest ones, so the bound cannot be ratcheted up
by a patient client. (Until 2026-11-27 an island in the round counted twice, its vote and its
entry, and the lower median of two islands' took the smaller: the vote, which lags. Two honest
islands' second rounds, after a first of a few warm-up steps, were scaled to 5% of their length,
29% of their contributions in all: 1.4 points of a simulated 2-island run's gap to DDP.)

- norm: an outer gradient longer than ``z`` x the reference is scaled down to that length
  (bounded, not refused: what it says is kept, only its size is limited). Before any history
  the fragment's own norm is the reference, so the bound works from the first round.
- weight: tokens per step above ``TOKENS_PER_STEP_FACTOR`` x the reference count as that, and
  steps above ``STEPS_FACTOR`` x H count as that; then no entry weighs more than
  ``WEIGHT_RATIO`` x the lower median weight of its round (:func:`capped_weights`). With the
  counter bounds alone one island could weigh 64x an honest one and outvote three; capped at 2x
  the median, one island of four cannot turn the merged direction (3 honest votes against 2).

In a round of any size, an entry's norm is bounded by ``ROUND_NORM_RATIO`` x its peers' lower
median (the reference above): the z bound alone let one
hostile island of two, alone in its rounds, step 10x an honest island's length the other way, and
the model diverged. In a round of three or more :func:`agreeing` also takes the weight of an
entry that points against the others.

Over time, :meth:`InfluenceGuard.budgets`: over the fragment's last ``window`` closed rounds an
island's share of the steps (weight share x bounded length) is kept within ``BUDGET_RATIO`` x the
lower median of the other islands' shares (those with a share in the last ``PRESENT_ROUNDS``) plus one typical
step, so opening many rounds, or sizing entries just
under the norm bound round after round, moves the model no further than an honest island does. Measured
(tests/adversarial/test_merge_attacks.py): one sign-flip or noise island of four for 30 rounds
left the model 4.5e9 / 1,920 from the target (honest: 0.99); with these rules 1.16 / 1.00.

A reference can be pushed *down* by an island reporting tiny values; it never falls below
``NORM_FLOOR`` of the fragment's norm, so such an island slows the others' steps at worst.

Every rule above bounds an island against its peers, and without an honest majority the peers
may be hostile: one island of two that sent the honest delta flipped, from the farthest place it
may claim, was held to its honest peer's size, but the honest island's steps grow as it corrects
against the flipped model, the bounds followed them, and the distance to the target grew
geometrically (issue 48; tests/adversarial/test_invariants.py: 10 -> 5,900-17,000 in 15 s, one
honest island alone 2.1). Two rules close it. An entry over its influence budget is cut in weight
as in length (:meth:`InfluenceGuard._within_budgets`): now 2.3-4.8 in 15 s. And the step itself is
bounded in absolute terms, by a rate the run established (:class:`StepBudget`, core/step_budget.py): an outer step moves
the fragment at most ``STEP_RATIO`` x the fragment's recent movement per step, a round that merged
at most half the islands taking part at most its share of one such step; the budget rises no
faster than linearly, falls with the recent steps, and a step it held lowers it, so a hostile half
of the run that keeps pushing drifts the model sublinearly (two colluding flippers of four, 30 s:
9.3e6 from the target with no budget, 132-442 with one that never fell, 4.6-153 with one that
falls). In an opposed round of three or more, what a client states (its counters, its claimed
base) buys nothing: one vote each (:func:`one_vote_each`; those flippers, grace window, 28x-94x
-> 9.9x-12.2x the honest-only distance in 30 s); a tie in numbers charges only the side its step
went (:func:`along_the_step`: 2.0x-5.2x, no longer drifting).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from lightning_diloco.core.merge import common_scale, contribution_weight, norm64
from lightning_diloco.core.step_budget import StepBudget

Number = TypeVar("Number", int, float)

TOKENS_PER_STEP_FACTOR = 4.0
STEPS_FACTOR = 4
NORM_FLOOR = 1e-3
WEIGHT_RATIO = 1.4
ROUND_NORM_RATIO = 1.4
PRESENT_ROUNDS = 4  # closed rounds: a peer with no share in them is away, not a yardstick
OPPOSED_AT = math.sqrt(0.75)  # opposition_scale: |sum w u|^2 >= 3/4 sum w^2 leaves the step untouched (two entries: cosine >= -0.25)
BUDGET_RATIO = 1.5  # x the peers' influence over the window: above WEIGHT_RATIO (1.0 trimmed honest islands of unequal tokens)


def lower_median(values: Iterable[Number]) -> Number | None:
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

    def votes(self, excluding: int | None = None) -> dict[int, float]:
        """Every island's vote but ``excluding``'s: an island's bound never follows its own values."""
        return {i: statistics.median(v) for i, v in self.values.items() if i != excluding}

    def reference(self, excluding: int | None, current: dict[int, float]) -> float | None:
        """The lower median of one value per island but ``excluding``: ``current[i]``, island i's
        value in this round, where it has one, else its vote."""
        return lower_median({**self.votes(excluding), **current}.values())

    def state_dict(self) -> dict[int, list[float]]:
        return {i: list(v) for i, v in self.values.items()}

    def load_state_dict(self, state: dict[int, list[float]]) -> None:
        self.values = {}
        for island, values in state.items():
            for value in values[-self.window:]:
                self.record(int(island), float(value))


class InfluenceWindow:
    """How far the fragment's last ``window`` closed rounds moved it on each island's behalf."""

    def __init__(self, window: int) -> None:
        self.rounds: deque[dict[int, float]] = deque(maxlen=window)

    def add(self, shares: dict[int, float]) -> None:
        self.rounds.append({i: v for i, v in shares.items() if math.isfinite(v)})

    def recent(self, rounds: int) -> set[int]:
        """The islands with a share in the last ``rounds`` closed rounds."""
        return {i for shares in list(self.rounds)[-rounds:] for i in shares}

    def totals(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for shares in self.rounds:
            for island, v in shares.items():
                out[island] = out.get(island, 0.0) + v
        return out

    def state_dict(self) -> list[dict[int, float]]:
        return [dict(r) for r in self.rounds]

    def load_state_dict(self, state: list[dict]) -> None:
        self.rounds.clear()
        window = self.rounds.maxlen
        assert window is not None  # made with maxlen in __init__
        for shares in state[-window:]:
            self.add({int(i): float(v) for i, v in shares.items()})


@dataclass(frozen=True)
class Bounded:
    scale: float
    """Factor applied to the outer gradient (1.0: untouched)."""
    tokens: float
    steps: int

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


class Contribution(Protocol):
    """What the bounds read of one contribution to a round (the synchronizer's ``Entry``)."""

    island: int
    base_version: int
    outer_gradient: torch.Tensor
    tokens: float
    steps: int
    norm: float


@dataclass(frozen=True)
class BoundedRound:
    """A round's contributions as they are merged."""

    gradients: list[torch.Tensor]
    """Each outer gradient, scaled down where a bound says so (a scaled one is a copy)."""
    weights: list[float]
    clipped: int
    """How many were scaled down."""
    shares: dict[int, float]
    """Each island's share of the step: weight share x bounded length (for the budget's window)."""


def capped_weights(weights: list[float], ratio: float = WEIGHT_RATIO) -> list[float]:
    """``weights`` with each capped at ``ratio`` x their lower median (one entry: unchanged)."""
    reference = lower_median(weights)
    if reference is None or len(weights) < 2:
        return list(weights)
    return [min(w, ratio * reference) for w in weights]


def one_vote_each(weights: list[float]) -> list[float]:
    """``weights`` in a round whose entries oppose one another: none above the lower median, and no
    age discount (docs/algorithm.md#bounds-on-one-contribution).

    What sets a weight apart is what its client states: its counters and the base it claims to
    have worked from, which the synchronizer cannot check and which cost the claimant nothing. In a
    round of agreeing entries that only shifts the step between islands heading the same way; in an
    opposed one it decides which side the step takes. Two far-place flippers of four, in every round
    of the grace window beside the honest islands, claimed the newest base, so the staleness
    discount halved the honest entries (one version older) and the flippers' side won every
    tug-of-war: 28x-94x the honest-only distance in 30 s. Held to the lower median, an entry
    weighs what a typical one does: the side with more islands wins, a tie cancels (12x-14x: the
    model stays near where it started, as nothing tells the two pairs apart). An entry below the
    median keeps its weight: stating less only lowers one's own.
    """
    reference = lower_median(weights)
    return list(weights) if reference is None else [min(w, reference) for w in weights]


def agreeing(weights: list[float], gradients: list[torch.Tensor], norms: list[float] | None = None) -> list[float]:
    """``weights`` scaled by how well each entry agrees with the others, in a round of three or more.

    An entry's agreement is the sum of its cosines with the other entries' outer gradients. One at
    or above the round's median agreement keeps its weight; one below is scaled by its share of
    the median, and one pointing against the others (negative) gets none. A sign-flipped or noise
    entry agrees with nobody, so it cannot pull the merged direction however it is sized; honest
    islands, which head the same way, keep about their weights. Costs two passes over the entries
    (the sum of their directions, then one dot product each), no copy of them; ``norms``: the
    gradients' norms if known (else computed).
    """
    if len(gradients) < 3:
        return list(weights)
    if norms is None:
        norms = [norm64(g) for g in gradients]
    directions = torch.zeros_like(gradients[0], dtype=torch.float32)
    inverse = [1.0 / n if n > 1e-300 else 0.0 for n in norms]  # (a float32 gradient has none below 1e-45 but 0)
    scale = common_scale(inverse)  # a gradient of subnormal values: 1 / |g| past float32's range
    for g, inv in zip(gradients, inverse):
        if inv:
            directions.add_(g, alpha=inv * scale)
    agreement = [float(torch.dot(g, directions)) / (n * scale) - 1.0 if inv else 0.0 for g, n, inv in zip(gradients, norms, inverse)]
    typical = statistics.median(agreement)
    if typical > 0:
        kept = [w * min(1.0, max(0.0, a / typical)) for w, a in zip(weights, agreement)]
    else:  # the round's entries disagree as a rule (e.g. noise near a minimum): only opposition is left out
        kept = [w if a >= 0 else 0.0 for w, a in zip(weights, agreement)]
    return kept if any(kept) else list(weights)


def opposition_scale(weights: Sequence[float], gradients: Sequence[torch.Tensor], norms: Sequence[float]) -> float:
    """The factor (at most 1) a merged step is shortened by when its entries oppose one another.

    RDA (core/merge.py) keeps the typical step length however much the entries' directions
    cancel, which is right when their disagreement is independent noise: n independent directions
    sum to about sqrt(n) unit lengths, and RDA's length makes up for it. Entries that *oppose*
    each other are no such noise, and there RDA turned a tug-of-war into a whole step for the side
    with the slight edge in weight: one flipped island against one honest one, in every round (the
    grace window's), drove the model from 10 to 55 from its target in 15 s, one honest island alone
    2.2 (issue 48). So the step keeps its length only as far as the entries are about independent
    or agree: the factor is |sum w_m u_m| / sqrt(sum w_m^2) (u_m: unit directions; 1 for independent
    ones), over ``OPPOSED_AT``, capped at 1. Entries heading the same way, as honest islands' do,
    and independent ones (with a margin: two entries at a cosine of -0.25 or more) are untouched;
    two sides that cancel shorten it toward 0. ``norms``: the gradients' norms; entries with no
    weight or no length take no part. One pass over the entries, no copy of them. Applied to RDA
    merges only (synchronizer/rounds.py): a plain weighted mean is shortened by the cancellation
    itself, and shortening it again took two honest islands of different data off DiLoCo's step.
    """
    live = _taking_part(weights, gradients, norms)
    if len(live) < 2:
        return 1.0
    directions, scale, top = _unit_sum(live)
    independent = math.sqrt(sum((w / top) ** 2 for w, _, _ in live))
    return min(1.0, norm64(directions) / scale / (independent * OPPOSED_AT))


def along_the_step(weights: Sequence[float], gradients: Sequence[torch.Tensor], norms: Sequence[float]) -> list[float]:
    """How much of each entry's direction the round's merged step takes: the cosine of its outer
    gradient with the weighted sum of the entries' unit directions (RDA's, core/merge.py), 0 for
    an entry against it. The influence budget counts an entry of an opposed round at its share
    times this (docs/algorithm.md#bounds-on-one-contribution).

    Why: in a tug-of-war the step goes one side's way. Charged whole shares, both sides spent
    influence alike, the budget held neither, and what tipped the early rounds tipped the rest
    (one flipper of two: up to 3.95x the one-honest distance). Charged what moved its way, the
    winner has spent its influence and the loser has not, so no side moves the fragment its way
    farther than the other, whichever is honest. One pass and a dot product each, no copies."""
    live = _taking_part(weights, gradients, norms)
    if not live:
        return [0.0] * len(gradients)
    direction, scale, top = _unit_sum(live)
    length = norm64(direction)
    if not length > 1e-6 * scale * sum(w / top for w, _, _ in live):  # (a tie: only rounding is left)
        return [0.0] * len(gradients)
    return [max(0.0, min(1.0, float(torch.dot(g, direction)) / (n * length))) if _takes_part(w, n) else 0.0
            for w, g, n in zip(weights, gradients, norms)]


def _takes_part(weight: float, norm: float) -> bool:  # in a round's sum of directions: some weight, a length
    return weight > 0 and math.isfinite(norm) and norm > 1e-300


def _taking_part(weights: Sequence[float], gradients: Sequence[torch.Tensor], norms: Sequence[float]) -> list[tuple[float, torch.Tensor, float]]:
    return [(w, g, n) for w, g, n in zip(weights, gradients, norms) if _takes_part(w, n)]


def _unit_sum(live: Sequence[tuple[float, torch.Tensor, float]]) -> tuple[torch.Tensor, float, float]:
    """(sum, scale, top): the (weight, gradient, norm) entries' unit directions summed, weighted by
    weight / ``top`` (the largest: products of 1e30 weights stay finite), times :func:`common_scale`'s
    ``scale`` (a subnormal gradient's 1 / |g| passes float32's range). One pass, no copies."""
    top = max(w for w, _, _ in live)
    scale = common_scale([w / top / n for w, _, n in live])
    total = torch.zeros_like(live[0][1], dtype=torch.float32)
    for w, g, n in live:
        total.add_(g, alpha=w / top / n * scale)
    return total, scale, top


class InfluenceGuard:
    """One fragment's bounds. ``z`` = 0 turns the norm bound off (the weight bound stays)."""

    def __init__(self, z: float, window: int, sync_every: int) -> None:
        self.z, self.sync_every = z, sync_every
        self.norms = IslandVotes(window)
        self.tokens_per_step = IslandVotes(window)
        self.influence = InfluenceWindow(window)
        self.step_budget = StepBudget()

    def bound(self, *, norm: float, tokens: float, steps: int, others: dict[int, tuple[float, float]],
              fragment_norm: float, numel: int, island: int | None = None) -> Bounded:
        """``others``: island -> (norm, tokens per step) of the round's contributions from other
        islands; ``island``: whose contribution it is (its own votes are left out of its reference)."""
        scale = 1.0
        if self.z > 0:
            peers = self.norms.reference(island, {i: n for i, (n, _) in others.items()})
            if peers is None:  # the first round of this fragment: its own size is the yardstick
                cap = self.z * max(fragment_norm, math.sqrt(numel))
            else:
                # z x the peers' yardstick, and in a round of any size at most ROUND_NORM_RATIO x it
                # (bounded only by z x the reference, 10x an honest step, one hostile island of two
                # alone in its rounds diverged the model)
                cap = max(min(self.z, ROUND_NORM_RATIO) * peers, NORM_FLOOR * fragment_norm)
            if norm > cap:
                scale = cap / norm
        steps_cap = STEPS_FACTOR * self.sync_every
        bounded_steps = min(steps, steps_cap)
        tps = tokens / steps
        reference_tps = self.tokens_per_step.reference(island, {i: t for i, (_, t) in others.items()})
        if reference_tps is not None:
            tps = min(tps, TOKENS_PER_STEP_FACTOR * reference_tps)
        return Bounded(scale, tps * bounded_steps, bounded_steps)

    def bound_round(self, entries: Sequence[Contribution], *, fragment: torch.Tensor, version: int,
                    staleness_discount: float) -> BoundedRound:
        """The merge rule's bounds for one round of ``entries`` on ``fragment`` at ``version``:
        each outer gradient scaled down to the norm bound and to its island's influence budget,
        and its merge weight (bounded tokens and steps, capped against the round's, discounted by
        age, taken from an entry that points against the others). The entries are not changed:
        a close that fails after this and is tried again bounds them once more from the same
        values, not a second time over."""
        fragment_norm = norm64(fragment)
        scales, weights, ages, norms = [], [], [], []
        for e in entries:
            others = {o.island: (o.norm, o.tokens / o.steps) for o in entries if o.island != e.island}
            b = self.bound(norm=e.norm, tokens=e.tokens, steps=e.steps, others=others,
                           fragment_norm=fragment_norm, numel=fragment.numel(), island=e.island)
            scales.append(b.scale)
            norms.append(e.norm * b.scale)
            # a base newer than the current version (kept by an island across a synchronizer
            # restart that lost the last versions) is as fresh as it gets: age 0
            ages.append(max(0, version - e.base_version))
            weights.append(contribution_weight(b.tokens, b.steps))
        # what the islands claim is capped against each other; the age discount is the synchronizer's own
        weights = capped_weights(weights)
        raw, raw_norms = [e.outer_gradient for e in entries], [e.norm for e in entries]
        opposed = len(entries) >= 2 and opposition_scale(weights, raw, raw_norms) < 1.0
        if len(entries) >= 3 and opposed:
            weights = one_vote_each(weights)
        else:
            weights = [w * contribution_weight(1.0, 1, age=a, staleness_discount=staleness_discount)
                       for w, a in zip(weights, ages)]
        weights = agreeing(weights, raw, raw_norms)
        along = along_the_step(weights, raw, raw_norms) if opposed else None
        if along is not None and 2 * sum(a > 0 for a in along) > len(along):
            along = None  # the side the step went is most of the round: the losing minority pays whole shares
        shares = self._within_budgets([e.island for e in entries], weights, norms, scales, along)
        if along is not None:  # the history keeps what the step, as cut, moved each island's way
            shares = dict(zip(shares, (share * a for share, a in zip(shares.values(), along_the_step(weights, raw, raw_norms)))))
        gradients = [e.outer_gradient * s if s < 1.0 else e.outer_gradient for e, s in zip(entries, scales)]
        return BoundedRound(gradients, weights, sum(s < 1.0 for s in scales), shares)

    def _within_budgets(self, islands: list[int], weights: list[float], norms: list[float],
                        scales: list[float], along: list[float] | None = None) -> dict[int, float]:
        """Scale each entry (in place, ``scales`` and ``weights``) so that its share of the step,
        its weight's share of the round times its bounded length (times ``along`` in an opposed
        round: :func:`along_the_step`), fits what its island may still move the fragment over the
        guard's window; returns each island's share (weight share x length, as cut).

        Both its length and its weight are scaled: RDA (core/merge.py) takes the merged direction
        from the weights alone, so an entry cut to a tenth of its length still pulled the direction
        with its whole weight. One hostile island of two, its length cut by the budget, turned the
        honest island's rounds away from the target with the weight of a fresher base (the
        staleness discount halves an entry one version old), round after round (issue 48)."""
        total = sum(weights)
        shares = [w / total * n if total > 0 else 0.0 for w, n in zip(weights, norms)]
        its_way = shares if along is None else [share * a for share, a in zip(shares, along)]
        reference = lower_median(norms) or 0.0
        factors = [1.0] * len(islands)
        for i, budget in enumerate(self.budgets(islands, reference)):
            if budget is not None and its_way[i] > budget:
                factors[i] = budget / its_way[i]
        if any(w * f for w, f in zip(weights, factors)):  # (none left: the step is nothing either way)
            weights[:] = [w * f for w, f in zip(weights, factors)]
        scales[:] = [s * f for s, f in zip(scales, factors)]
        return {i: share * f for i, share, f in zip(islands, shares, factors)}

    def knows_a_peer_of(self, island: int) -> bool:
        """Whether a contribution of another island has been merged: its vote is the yardstick
        that bounds this island's entry alone in a round. Without one, nothing bounds it but z x
        the fragment's own norm."""
        return bool(self.norms.votes(island))

    def record(self, island: int, norm: float, tokens: float, steps: int) -> None:
        """A merged contribution's raw values become its island's vote (clipped or not)."""
        self.norms.record(island, norm)
        self.tokens_per_step.record(island, tokens / steps)

    def budgets(self, islands: list[int], step_reference: float) -> list[float | None]:
        """How far each of ``islands`` may still move the fragment in this round (None: no bound
        yet, before any other island's influence is known): the lower median of the other islands'
        influence over the window times ``BUDGET_RATIO`` (1 against a single peer), and one
        ``step_reference`` of slack, less its own."""
        spent, present = self.influence.totals(), self.influence.recent(PRESENT_ROUNDS)
        out = []
        for island in islands:
            # peers still taking part: one paused or killed keeps its total while the others go on,
            # and bounding them by it stopped the model for as long as it was away
            others = [t for i, t in spent.items() if i != island and i in present]
            if len(others) >= 2:
                # the median of every island taking part, this one's own included, sits between two
                # honest islands' totals while fewer than half are hostile, however low or high the
                # hostile ones keep theirs: of the others' alone, with two of them, the lower median
                # was the smaller, and one hostile island of three whose entries the bounds had
                # taken away held its honest peers' budgets at nothing for 9 rounds while the
                # outer momentum carried the model off (2026-11-27, arena seed 11: 15.2 from the
                # target, started at 10; the honest islands alone end at 1.7)
                peers, ratio = lower_median([*others, spent.get(island, 0.0)]), BUDGET_RATIO
            else:
                # one peer: nothing tells which of the two is honest, so neither may outdo the other
                # (at 1.5x one hostile island of two drove the model from 10 to 199 from its target)
                peers, ratio = lower_median(others), 1.0
            out.append(None if peers is None else max(0.0, ratio * peers + step_reference - spent.get(island, 0.0)))
        return out

    def record_round(self, shares: dict[int, float]) -> None:
        """A closed round's influence: how far it moved the fragment on each island's behalf."""
        self.influence.add(shares)

    def state_dict(self) -> dict:
        """The votes, for a checkpoint: a restart without them bounded the next round as the run's
        first, by the fragment's own norm (a lone push then moved the model 13.3x its norm, 0.12x
        with the votes: tests/synchronizer/test_rounds.py)."""
        return {"norms": self.norms.state_dict(), "tokens_per_step": self.tokens_per_step.state_dict(),
                "influence": self.influence.state_dict(), "step_budget": self.step_budget.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.norms.load_state_dict(state.get("norms", {}))
        self.tokens_per_step.load_state_dict(state.get("tokens_per_step", {}))
        self.influence.load_state_dict(state.get("influence", []))
        # none in checkpoints before issue 48: the budget warms up again from the next steps
        self.step_budget.load_state_dict(state.get("step_budget", {}))
