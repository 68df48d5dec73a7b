"""What no island may achieve with its own credential, whatever it sends, checked as invariants
over seeded random adversaries (arena.py) rather than against a list of attacks.

Each case draws, tick by tick, the hostile islands' rounds (their own, the fragment's next, a few
ahead, 2**40), counters (honest, 1e15 tokens in one step, 10**6 steps), direction (sign flip,
"away" inside the honest spread, noise, ALIE, min-max) and size (1x to 100x), heartbeats (place 0,
the honest one, 2**62; step time 1e-9, honest, 1e9), rejoins, joins as an honest island with no
session and joins saying a wrong island count; or, drawn per hostile island from the seed, the
island is a far-place flipper (arena.py: the flipped honest delta from the farthest place, every
tick; drawn since two flippers of one run keep the bound with the grace window too). Budget: 5 cases of each of 5
mixes of honest and hostile islands, 300 ticks (about 75 rounds) each, about 10 s in all; once with
rounds closing at their first send, once with the library's grace window (half the fragment's
round: over 20 seeds, one hostile of four moved the model 1.15x the honest-only distance at the
median, 1.63x at worst, against 1.62x / 2.48x closing at the first send; one of three 1.28x /
2.22x and 1.66x / 2.72x, where it reached 9.13x before the budgets' reference counted each
island's own total and a fragment's first round waited for a second island; benchmarks/RESULTS.md).

Invariants, for every case:
- the global model stays finite and bounded (before: 1,000-1e10 times the start distance);
- with one hostile island of four it stays within ``RATIO_1_OF_4`` x the honest-only distance of
  the same seed (the aim is 1.5x; measured over 20 seeds closing at the first send: median 1.62x,
  worst 2.48x), with one of three within ``RATIO_1_OF_3`` x (worst over 20 seeds 2.72x);
- the run's clock is never more than one round (H) ahead of the furthest honest island's own
  steps (before: 2,336-4,660 steps of clock for about 350 inner steps);
- honest islands' contributions keep being merged, to the end of the run;
- a round holds at most one entry per island, an island at most one pending request per fragment;
- no honest island's join is refused: hostile islands that join first with a wrong count, or as
  an honest island's index with no session (arena.py), lock no one out (before issue 48's
  quorum rule the first island's count was the run's).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from benchmarks.arena import MIXES, Arena, H, honest_distance
from lightning_diloco.synchronizer.requests import Refusal
from tests.helpers import contribution

TICKS = 300
RATIO_1_OF_4 = 2.5
RATIO_1_OF_3 = 3.0
BOUNDED = 5.0  # x the start distance: far from the target, but not diverging


@pytest.mark.parametrize("grace_gamma", [0.0, 0.5], ids=["close-at-first-send", "default-grace-window"])
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("honest", "hostile"), MIXES)
def test_no_hostile_mix_breaks_the_runs_invariants(honest, hostile, seed, grace_gamma):
    arena = Arena(honest, hostile, seed, grace_gamma=grace_gamma)
    report = arena.run(TICKS // 2)
    start, first_half = report.start_distance, dict(report.merged)
    report = arena.run(TICKS - TICKS // 2)
    assert math.isfinite(report.distance) and report.distance < BOUNDED * start, report
    bound = {(3, 1): RATIO_1_OF_4, (2, 1): RATIO_1_OF_3}.get((honest, hostile))
    if bound is not None:
        assert report.distance <= bound * honest_distance(honest, seed, TICKS, grace_gamma=grace_gamma), report
    assert report.clock_lead <= H, report
    assert all(report.merged[i] > first_half[i] for i in first_half), (first_half, report.merged)
    assert report.largest_round <= honest + hostile and report.largest_requests <= 1, report
    assert report.honest_joins_refused == 0, report  # no slot taken, no count squatted


def test_the_round_lead_attack_moves_neither_the_clock_nor_the_model():
    """The fourth attack pass's round lead: after every close the hostile island pushes a sign-flipped
    delta no longer than an honest one, with honest counters, for round 2**40. It was admitted as
    the round 4H ahead of the clock, opened it, and every honest island was asked to skip to it:
    the clock ran 10x ahead of the islands' steps and the model went from 2.36 to 1.95e10 from the
    target in 15 s. Now it is taken for a round past its own place, no honest island is asked to
    skip to it, and its influence over the window is an honest island's at most."""
    arena = Arena(3, 1, seed=7)

    def lead(island: int) -> None:
        arena.hostile_seq[island] += 1
        push = contribution(arena.config, island, 0, arena._hostile_delta("flip", 1.0), round=2**40,
                            base_version=arena.sync.versions()[0], seq=arena.hostile_seq[island], tokens=400.0, steps=H)
        try:
            arena.sync.push(replace(push, session=arena.sessions[island]))
        except Refusal:  # a refusal is a fine answer to an attack
            pass

    arena._hostile_tick = lead
    report = arena.run(TICKS)
    assert report.clock_lead <= H, report
    assert report.distance <= RATIO_1_OF_4 * honest_distance(3, 7, TICKS), report


@pytest.mark.parametrize("grace_gamma", [0.0, 0.5], ids=["close-at-first-send", "default-grace-window"])
@pytest.mark.parametrize("seed", [*range(5), 16])
def test_one_far_place_flipper_of_two_cannot_drive_the_model_away(seed, grace_gamma):
    """Issue 48's attack: one honest island and one that, every tick, heartbeats from the farthest
    place (the synchronizer bounds it to the clock + H) and pushes the honest delta sign-flipped,
    honest-sized or 1.5x, with honest or maximum counters. Without an honest majority nothing tells
    which island is honest; the entry was held to the honest one's size, yet the distance to the
    target grew geometrically as the honest island's corrections grew (15 s: 5,900-17,000 from the
    target, one honest island alone 2.1). The step budget, the influence budget's weight cut and
    opposed entries shortening the step (core/guard.py) held it, but with the grace window both
    islands are in every round, the influence budget charged both sides of each tug-of-war alike,
    and the rounds the flipper won early (the honest entry a version older) carried on: seeds 2, 4
    and 16 ended 3.29x, 3.58x and 3.95x the one-honest distance. Charged for what the step moved
    its way (core/guard.py along_the_step), the side that won has spent its influence and the next
    rounds go to the other: every seed within 3x (20 seeds: at worst 2.69x)."""
    arena = Arena(1, 1, seed, grace_gamma=grace_gamma)
    arena.kinds = {i: "far_flip" for i in arena.hostile}
    report = arena.run(TICKS // 2)
    start = report.start_distance
    assert report.distance <= 3.0 * honest_distance(1, seed, TICKS // 2, grace_gamma=grace_gamma), report
    report = arena.run(TICKS - TICKS // 2)
    assert math.isfinite(report.distance) and report.distance < BOUNDED * start, report


def test_two_colluding_far_place_flippers_of_four_cannot_hold_the_model_away_from_the_target():
    """Issue 48: two far-place flippers of four agree with each other in rounds of their own opened
    ahead of the clock, and with the grace window are in every round beside the honest islands,
    where their identical directions outweighed the two honest islands' noisy ones in every
    tug-of-war. With one vote each in an opposed round and a falling step budget the model still
    drifted away, ever slower (seed 0: 10 -> 14.6 / 18.9 / 23.8 from the target at 15 / 30 / 60 s).
    Charged for what the step moved their way (core/guard.py along_the_step), the side that won a
    round has spent its influence and the next go to the other: after the first 10 s the model
    stays well inside its start distance (seed 0: 2.3-6.2 every 5 s to 60 s; honest-only 1.6)."""
    arena = Arena(2, 2, seed=0, grace_gamma=0.5)
    arena.kinds = {i: "far_flip" for i in arena.hostile}
    start = arena.run(0).distance
    arena.run(TICKS // 3)
    every_5_s = [arena.run(TICKS // 6).distance for _ in range(10)]
    assert all(math.isfinite(d) for d in every_5_s) and max(every_5_s) < 0.75 * start, (start, every_5_s)
