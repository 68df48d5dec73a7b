"""A deterministic run of the real synchronizer against honest and hostile islands, for the
trust invariants (test_invariants.py).

The synchronizer is the real service (admission, membership and its clock, rounds, guard, RDA
merge, outer step), driven tick by tick on a fake clock so one seed reproduces a run exactly.
Honest islands train toward a common target (a fixed fraction of the way each step, with noise,
as local training toward a shared minimum would), send their fragment when their schedule says,
apply the new global version one step later, heartbeat every second and realign to the round
requests the synchronizer hands them, as the learner does; each holds the session its join
was given and presents it, joining again (presenting its last one, as the client does) when a
call is refused for its session. Every island joins as a remote one does (``previous_session``
said) and says the run's island count. Hostile islands hold their own credential and nothing
more: each tick one may push (for any round, with any counters, any direction and size),
heartbeat (any place, any step time), rejoin, or stay quiet, as a seeded random generator
chooses. Two moves need no credential of theirs: a join that leaves the session out (taken as
none, "") as an honest island's index, the slot hijack of a run without a token (issue 48), and
a squat of the island count (joining first, and again later, saying 1, 10000 or another wrong
count); the islands join in a random order, hostile ones first as often as not.

With ``far_flip`` (the default) a hostile island is one of two kinds, drawn per island from the
seed: the random one above, or (issue 48) a far-place flipper, the fifth attack pass's move: every
tick it heartbeats from the farthest place it may claim (2**62; the synchronizer bounds it to the
clock + H) and pushes the honest islands' delta sign-flipped, at their size or 1.5x, with honest or
maximum counters, for a round far ahead. It sends what an honest island could, every round, on the
fastest schedule the synchronizer allows, and only its direction is wrong. test_invariants.py also
runs it against one honest island, and two of them against two. It became the default once two
flippers in one run kept the invariants' bound (5x the start) with the grace window too: there
they are in every round beside the honest islands, and their entries outweighed the honest ones
(their claimed base the newest) until an opposed round gave every entry one vote (2026-11-28,
5 seeds, gamma 0.5: 2 + 2 worst 45.6x -> 12.0x, 3 + 2 32.8x -> 2.37x the honest-only distance;
benchmarks/RESULTS.md). ``far_flip=False`` (``--no-far-flip``): random hostile islands only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import torch

from benchmarks.fakes import SPECS, FakeClock, contribution, initial_fragments
from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.config import CodecConfig, MergeConfig, OuterConfig, RunConfig, ScheduleConfig
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.requests import Refusal
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings

H = 4
TICK_S = 0.1  # seconds per honest inner step
HEARTBEAT_EVERY = 10  # ticks (1 s, as the learner's heartbeat)
RATE = 0.03  # of the way to the target an honest island goes per step (about 0.1 per round)
NOISE = 0.02
TOKENS_PER_STEP = 100.0
DIRECTIONS = ("flip", "away", "noise", "alie", "minmax", "honest")
ROUND_CHOICES = ("own", "next", "ahead", "huge")
COUNTERS = ("honest", "max_tokens", "one_step", "many_steps")
SCALES = (1.0, 1.0, 1.5, 10.0, 100.0)
KINDS = ("random", "far_flip")


def arena_config(grace_gamma: float = 0.0) -> RunConfig:
    """``grace_gamma`` 0: every round closes at its first send; the library's 0.5 waits up to half
    the fragment's round for the others' (``grace_slack="round"``)."""
    return RunConfig(schedule=ScheduleConfig(num_fragments=1, sync_every=H, overlap_steps=1),
                     merge=MergeConfig(min_quorum=1, grace_gamma=grace_gamma),
                     outer=OuterConfig(lr=0.7, momentum=0.9),
                     codec=CodecConfig(uplink="fp32", downlink="fp32"))


@dataclass
class Honest:
    island: int
    every: int  # ticks per inner step (1: full speed; 2: half)
    local: torch.Tensor
    base: torch.Tensor
    version: int
    steps: int = 0
    schedule_step: int = 0
    sent_round: int = -1
    apply_at: int | None = None
    realigned_at: int | None = None
    seq: int = 0
    last_delta: torch.Tensor | None = None
    session: str = ""


@dataclass
class Report:
    distance: float
    start_distance: float
    versions: int
    merged: dict[int, int]
    """Contributions merged per honest island."""
    clock_lead: int
    """The most the run's clock was ever ahead of the furthest honest island's own steps."""
    largest_round: int
    """Entries in the largest round that waited."""
    largest_requests: int
    refused: dict[str, int] = field(default_factory=dict)
    honest_joins_refused: int = 0
    """Joins (first or again) of honest islands the synchronizer refused: a taken slot, a squatted count."""


class Arena:
    def __init__(self, honest: int, hostile: int, seed: int, *, slow: tuple[int, ...] = (), grace_gamma: float = 0.0,
                 far_flip: bool = True) -> None:
        self.rng = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.config = arena_config(grace_gamma)
        self.clock = FakeClock()
        self.sync = Synchronizer(self.config, SynchronizerSettings(clock=self.clock))
        start = initial_fragments(self.config)[0]
        self.numel = start.numel()
        self.target = start + 10.0 * torch.nn.functional.normalize(torch.randn(self.numel, generator=self.g), dim=0)
        self.num_islands = honest + hostile
        self.honest = [Honest(i, 2 if i in slow else 1, start.clone(), start.clone(), 0) for i in range(honest)]
        self.hostile = list(range(honest, honest + hostile))
        self.sessions: dict[int, str] = {}
        self.hostile_seq = {i: 0 for i in self.hostile}
        # drawn apart from the run's generator: each island's kind is its own, whatever the mix
        self.kinds = {i: random.Random(f"{seed}-kind-{i}").choice(KINDS) if far_flip else "random" for i in self.hostile}
        self.tick_index = 0
        self.clock_lead = self.largest_round = self.largest_requests = self.honest_joins_refused = 0
        order = [("honest", h) for h in self.honest] + [("hostile", i) for i in self.hostile]
        self.rng.shuffle(order)
        for kind, who in order:
            if kind == "honest":
                self._honest_join(who)
            else:
                self._hostile_join(who, self.rng.choice(self._squat_counts(who)))
        self.sync.seed(0, 0, get_codec("fp32").encode(start))

    def _honest_join(self, h: Honest) -> None:
        """As the client joins: the session it last had ("" the first time) and the run's count."""
        try:
            h.session = self.sync.join(h.island, 1, SPECS, num_islands=self.num_islands, previous_session=h.session).session
        except Refusal:
            self.honest_joins_refused += 1

    # ---- honest islands, as the learner behaves -----------------------------------------------

    def _honest_tick(self, h: Honest) -> None:
        if self.tick_index % h.every:
            return
        h.local += RATE * (self.target - h.local) + NOISE * torch.randn(self.numel, generator=self.g)
        h.steps += 1
        h.schedule_step += 1
        with self.sync.membership.lock:
            requests = self.sync.membership.take_requests(h.island, self.clock())
        furthest = max((r.due_step for r in requests), default=-1)
        if furthest > h.schedule_step and (h.realigned_at is None or h.steps - h.realigned_at >= H):
            h.schedule_step, h.realigned_at = furthest, h.steps
        wanted = max([r.round for r in requests] + ([h.schedule_step // H] if h.schedule_step % H == 0 else []),
                     default=-1)
        if h.apply_at is not None and h.steps >= h.apply_at:
            version, value = self.sync.pull(0)
            h.local, h.base, h.version, h.apply_at = value.clone(), value.clone(), version, None
        if wanted > h.sent_round and h.apply_at is None:
            h.last_delta = h.local - h.base
            h.seq += 1
            push = contribution(self.config, h.island, 0, h.last_delta, round=wanted, base_version=h.version, seq=h.seq,
                                tokens=TOKENS_PER_STEP * H, steps=H)
            self._honest_call(h, lambda: self.sync.push(replace(push, session=h.session)))
            h.sent_round, h.apply_at = wanted, h.steps + 1
        if self.tick_index % HEARTBEAT_EVERY == 0:
            self._honest_call(h, lambda: self.sync.heartbeat(h.island, h.steps, TICK_S * h.every,
                                                             schedule_step=h.schedule_step, session=h.session))

    def _honest_call(self, h: Honest, call) -> None:
        """A call of the island's; refused for its session (its slot was taken), it joins again
        and sends once more, as the client does."""
        try:
            call()
        except Refusal as refusal:
            if refusal.reason not in (Reason.WRONG_SESSION, Reason.NOT_JOINED):
                return  # a refused push (late, superseded, ...) is the round's business
            self._honest_join(h)
            try:
                call()
            except Refusal:
                pass

    # ---- hostile islands: a random choice each tick --------------------------------------------

    def _honest_deltas(self) -> list[torch.Tensor]:
        return [h.last_delta for h in self.honest if h.last_delta is not None] or [
            RATE * H * (self.target - self.sync.pull(0)[1])]

    def _hostile_delta(self, direction: str, scale: float) -> torch.Tensor:
        deltas = torch.stack(self._honest_deltas())
        mean = deltas.mean(0)
        spread = deltas.std(0) if len(deltas) > 1 else 0.1 * mean.abs()
        if direction == "flip":
            return -scale * mean
        if direction == "away":  # inside the honest spread, leaning away from the honest mean
            return mean - spread * torch.sign(mean) * scale
        if direction == "noise":
            return scale * mean.norm() * torch.nn.functional.normalize(torch.randn(self.numel, generator=self.g), dim=0)
        if direction == "alie":  # a little is enough: mean minus z x the spread, per coordinate
            return mean - 1.5 * spread * scale
        if direction == "minmax":  # as far from the mean as the farthest honest delta, straight against it
            radius = max(float((d - mean).norm()) for d in deltas) or float(mean.norm())
            return mean - radius * scale * torch.nn.functional.normalize(mean, dim=0)
        return mean

    def _squat_counts(self, island: int) -> tuple[int, ...]:
        """Counts a hostile island may say: the run's, and wrong ones it can say (one above its index at least)."""
        return (self.num_islands, 10_000, island + 1, max(island + 1, self.num_islands - 1), self.num_islands + 1)

    def _hostile_join(self, island: int, count: int, *, as_island: int | None = None) -> None:
        """A join saying ``count``: as itself presenting its own last session, or (``as_island``) as
        an honest island's index leaving the session out (a remote join's unset is "")."""
        try:
            if as_island is None:
                self.sessions[island] = self.sync.join(island, 1, SPECS, num_islands=count,
                                                       previous_session=self.sessions.get(island, "")).session
            else:
                self.sync.join(as_island, 1, SPECS, num_islands=count, previous_session="")
        except Refusal:
            pass

    def _hostile_tick(self, island: int) -> None:
        if self.kinds[island] == "far_flip" and island in self.sessions:
            self._far_flip_tick(island)
            return
        action = self.rng.choice(("push", "push", "heartbeat", "quiet", "quiet", "rejoin", "hijack", "squat"))
        if island not in self.sessions:  # its first join was refused (a count it may not say): as itself again
            self._hostile_join(island, self.num_islands)
            return
        try:
            if action == "push":
                self._hostile_push(island)
            elif action == "heartbeat":
                place = self.rng.choice((0, max(h.schedule_step for h in self.honest), 2**62))
                step_time = self.rng.choice((1e-9, TICK_S, 1e9))
                self.sync.heartbeat(island, self.rng.choice((0, 10**12)), step_time, schedule_step=place,
                                    session=self.sessions[island])
            elif action == "rejoin" and self.rng.random() < 0.05:
                self._hostile_join(island, self.num_islands)
            elif action == "hijack":
                self._hostile_join(island, self.num_islands, as_island=self.rng.choice(self.honest).island)
            elif action == "squat" and self.rng.random() < 0.2:
                self._hostile_join(island, self.rng.choice(self._squat_counts(island)))
        except Refusal:
            pass

    def _far_flip_tick(self, island: int) -> None:
        """The far-place flipper: heartbeat from 2**62, push the flipped honest delta, each tick."""
        try:
            self.sync.heartbeat(island, max(h.steps for h in self.honest), TICK_S, schedule_step=2**62,
                                session=self.sessions[island])
            counters = self.rng.choice(("honest", "max_tokens"))
            tokens, steps = (TOKENS_PER_STEP * H, H) if counters == "honest" else (1e15, 1)
            self.hostile_seq[island] += 1
            push = contribution(self.config, island, 0, self._hostile_delta("flip", self.rng.choice((1.0, 1.5))),
                                round=2**40, base_version=self.sync.versions()[0], seq=self.hostile_seq[island],
                                tokens=tokens, steps=steps)
            self.sync.push(replace(push, session=self.sessions[island]))
        except Refusal:
            pass

    def _hostile_push(self, island: int) -> None:
        own = max(h.schedule_step for h in self.honest) // H
        choice = self.rng.choice(ROUND_CHOICES)
        round_index = {"own": own, "next": max(0, self.sync.run.fragments[0].state.next_round), "ahead": own + 4, "huge": 2**40}[choice]
        counters = self.rng.choice(COUNTERS)
        tokens, steps = {"honest": (TOKENS_PER_STEP * H, H), "max_tokens": (1e15, 1), "one_step": (TOKENS_PER_STEP, 1),
                         "many_steps": (1e12, 10**6)}[counters]
        delta = self._hostile_delta(self.rng.choice(DIRECTIONS), self.rng.choice(SCALES))
        self.hostile_seq[island] += 1
        push = contribution(self.config, island, 0, delta, round=round_index, base_version=self.sync.versions()[0],
                            seq=self.hostile_seq[island], tokens=tokens, steps=steps)
        self.sync.push(replace(push, session=self.sessions[island]))

    # ---- the run ---------------------------------------------------------------------------------

    def run(self, ticks: int) -> Report:
        start = float((self.sync.pull(0)[1] - self.target).norm())
        for _ in range(ticks):
            self.tick_index += 1
            self.clock.advance(TICK_S)
            order = [("honest", h) for h in self.honest] + [("hostile", i) for i in self.hostile]
            self.rng.shuffle(order)
            for kind, who in order:
                if kind == "honest":
                    self._honest_tick(who)
                else:
                    self._hostile_tick(who)
            self._observe()
            self.sync.poll()
        status = self.sync.status()
        return Report(distance=float((self.sync.pull(0)[1] - self.target).norm()), start_distance=start,
                      versions=self.sync.versions()[0],
                      merged={h.island: status.islands[h.island].accepted for h in self.honest},
                      clock_lead=self.clock_lead, largest_round=self.largest_round,
                      largest_requests=self.largest_requests, refused=dict(status.refused),
                      honest_joins_refused=self.honest_joins_refused)

    def _observe(self) -> None:
        furthest_own = max(h.steps for h in self.honest)
        self.clock_lead = max(self.clock_lead, self.sync.run.run_step() - furthest_own)
        self.largest_round = max(self.largest_round, len(self.sync.run.fragments[0].rounds.entries))
        with self.sync.membership.lock:
            pending = max((len(m.requests) for m in self.sync.membership.members.values()), default=0)
        self.largest_requests = max(self.largest_requests, pending)


def honest_distance(honest: int, seed: int, ticks: int, slow: tuple[int, ...] = (), grace_gamma: float = 0.0) -> float:
    return Arena(honest, 0, seed, slow=slow, grace_gamma=grace_gamma).run(ticks).distance


MIXES = [(3, 1), (2, 1), (1, 1), (2, 2), (3, 2)]  # (honest, hostile)


def main(argv: list[str] | None = None) -> None:
    """The figures behind test_invariants.py's bounds: each mix's model distance over the
    honest-only run's of the same seed, median and worst over ``--seeds`` seeds.

        python -m benchmarks.arena --seeds 20 --grace-gamma 0.5
    """
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=20, help="seeds per mix (default %(default)s)")
    p.add_argument("--ticks", type=int, default=300, help="ticks per run, 0.1 s each (default %(default)s)")
    p.add_argument("--grace-gamma", type=float, default=0.0,
                   help="0: rounds close at their first send; 0.5: the library's window (default %(default)s)")
    p.add_argument("--no-far-flip", dest="far_flip", action="store_false",
                   help="random hostile islands only; by default each is a far-place flipper or a random one, "
                        "drawn per seed (issue 48)")
    args = p.parse_args(argv)
    for honest, hostile in MIXES:
        reports = {seed: Arena(honest, hostile, seed, grace_gamma=args.grace_gamma, far_flip=args.far_flip).run(args.ticks)
                   for seed in range(args.seeds)}
        ratios = {seed: r.distance / honest_distance(honest, seed, args.ticks, grace_gamma=args.grace_gamma)
                  for seed, r in reports.items()}
        ordered = sorted(ratios.values())
        worst = max(ratios, key=ratios.__getitem__)
        locked_out = sum(r.honest_joins_refused > 0 for r in reports.values())
        print(f"{honest} honest + {hostile} hostile: model distance / honest-only, median {ordered[len(ordered) // 2]:.2f}x, "
              f"worst {ratios[worst]:.2f}x (seed {worst}); runs with an honest join refused: {locked_out}")

if __name__ == "__main__":
    main()
