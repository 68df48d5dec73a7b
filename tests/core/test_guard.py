"""Bounds on one contribution's pull on a round: they hold from the first round and cannot be ratcheted."""

import math

import pytest

from lightning_diloco.core.guard import InfluenceGuard, lower_median, opposition_scale
from lightning_diloco.core.step_budget import StepBudget


def _guard():
    return InfluenceGuard(z=10.0, window=8, sync_every=24)


def test_lower_median_ignores_non_finite_values_and_takes_the_lower_middle():
    assert lower_median([3.0, 1.0, float("nan"), 2.0, 10.0]) == 2.0
    assert lower_median([5.0, 1.0]) == 1.0 and lower_median([]) is None


def test_the_first_round_is_bounded_by_the_fragments_own_size():
    b = _guard().bound(norm=1e20, tokens=100.0, steps=4, others={}, fragment_norm=3.0, numel=4)
    assert b.clipped and 1e20 * b.scale == pytest.approx(10.0 * 3.0)


def test_an_honest_contribution_is_left_alone():
    guard = _guard()
    for r in range(5):
        guard.record(0, 1.0 + 0.1 * r, 100.0, 4)
    b = guard.bound(norm=1.3, tokens=100.0, steps=4, others={0: (1.1, 25.0)}, fragment_norm=50.0, numel=100, island=1)
    assert b.scale == 1.0 and (b.tokens, b.steps) == (100.0, 4)


def test_a_patient_island_cannot_ratchet_the_bound_up():
    guard = _guard()
    honest = 1.0
    norm = honest
    for _ in range(200):  # the attacker pushes the most it may, round after round
        guard.record(0, honest, 100.0, 4)
        b = guard.bound(norm=1e12, tokens=100.0, steps=4, others={0: (honest, 25.0)}, fragment_norm=50.0, numel=100,
                        island=1)
        norm = 1e12 * b.scale
        guard.record(1, 1e12, 100.0, 4)  # its raw values become its vote
    # the peers' yardstick (the honest island's entry in the round), in a round of two too
    assert norm == pytest.approx(1.4 * honest)


def test_two_honest_islands_are_measured_against_each_others_entry_not_a_lagging_vote():
    """A fragment's first round comes after a few warm-up steps, its outer gradients a small
    fraction of a whole round's. The peer's vote from it lagged behind, and the lower median of a
    vote and an entry is the smaller: two honest islands' second rounds were scaled to 5% of their
    length (a 2-island run, 2026-11-27). Each island's own entry in the round is its value now."""
    guard = _guard()
    guard.record(0, 0.022, 3 * 256.0, 3)  # the first round: 3 steps into the warm-up
    guard.record(1, 0.022, 3 * 256.0, 3)
    for island, peer in ((0, 1), (1, 0)):
        b = guard.bound(norm=0.58, tokens=24 * 256.0, steps=24, others={peer: (0.57, 256.0)},
                        fragment_norm=5.0, numel=100, island=island)
        assert b.scale == 1.0, b
    # alone in its round, an island is still measured against its peer's vote
    b = guard.bound(norm=0.58, tokens=24 * 256.0, steps=24, others={}, fragment_norm=5.0, numel=100, island=0)
    assert 0.58 * b.scale == pytest.approx(1.4 * 0.022)


def test_absurd_counters_count_as_a_sane_multiple_of_the_runs():
    guard = _guard()
    guard.record(0, 1.0, 24 * 1024.0, 24)
    b = guard.bound(norm=1.0, tokens=1e15, steps=10**9, others={0: (1.0, 1024.0)}, fragment_norm=50.0, numel=100, island=1)
    assert b.steps == 4 * 24 and b.tokens == pytest.approx(4 * 24 * 4 * 1024.0)
    assert math.isfinite(b.tokens)


def test_a_reference_pushed_to_zero_stays_above_a_floor_of_the_fragments_norm():
    guard = _guard()
    b = guard.bound(norm=1.0, tokens=100.0, steps=4, others={0: (0.0, 25.0)}, fragment_norm=50.0, numel=100, island=1)
    assert b.scale * 1.0 == pytest.approx(1e-3 * 50.0)  # slowed, never stopped


def test_no_entry_weighs_more_than_1_4x_the_rounds_lower_median():
    from lightning_diloco.core.guard import capped_weights

    assert capped_weights([1.0, 1.0, 1.0, 64.0]) == [1.0, 1.0, 1.0, 1.4]
    assert capped_weights([5.0]) == [5.0]  # alone, nothing to compare with
    assert capped_weights([1.0, 1.2]) == [1.0, 1.2]  # within the cap: untouched


def test_an_entry_against_the_others_gets_no_weight_and_agreeing_ones_keep_theirs():
    import torch

    from lightning_diloco.core.guard import agreeing

    g = torch.Generator().manual_seed(0)
    way = torch.randn(100, generator=g)
    honest = [way + 0.1 * torch.randn(100, generator=g) for _ in range(3)]
    assert agreeing([1.0] * 4, [*honest, -50 * way])[3] == 0.0  # a sign flip, however long
    kept = agreeing([1.0] * 4, [*honest, 50 * torch.randn(100, generator=g)])
    assert kept[3] < 0.3 and min(kept[:3]) > 0.9  # noise agrees with nobody
    assert agreeing([1.0, 2.0], [way, -way]) == [1.0, 2.0]  # two entries: no majority to follow


def test_agreement_with_a_gradient_of_subnormal_values_is_measured_not_raised():
    """Its unit vector's float32 factor 1 / |g| (7e44) overflowed: a round of three or more holding
    one such entry raised in every close. The honest entries keep their weights."""
    import torch

    from lightning_diloco.core.guard import agreeing

    honest = [torch.full((1000,), 0.01), torch.full((1000,), 0.02)]
    weights = agreeing([1.0, 2.0, 3.0], [*honest, torch.full((1000,), 1e-45)])
    assert weights[:2] == [1.0, 2.0] and all(math.isfinite(w) and w >= 0 for w in weights)


def test_an_island_that_moved_the_model_least_cannot_hold_its_peers_budgets_at_nothing():
    """One hostile island of three whose entries the bounds had taken away (nothing spent) was the
    lower median of each honest island's two peers: their budgets stayed at nothing for 9 rounds
    while the outer momentum carried the model off (the trust arena, seed 11). The reference is the
    median of every island taking part, its own total included."""
    guard = _guard()
    for _ in range(6):
        guard.record_round({0: 1.0, 1: 1.0, 2: 0.0})
    honest, other_honest, hostile = guard.budgets([0, 1, 2], step_reference=0.5)
    assert honest == other_honest == pytest.approx(1.5 * 6.0 + 0.5 - 6.0)  # half its total again, and a step
    assert hostile == pytest.approx(1.5 * 6.0 + 0.5)  # never past 1.5x an honest island's
    guard.record_round({0: 1.0, 1: 1.0, 2: 100.0})  # nor does a hostile total raise the others' reference
    assert guard.budgets([2], step_reference=0.5) == [0.0]
    assert guard.budgets([0], step_reference=0.5) == [pytest.approx(1.5 * 7.0 + 0.5 - 7.0)]


def test_a_feedback_loop_that_pushes_past_the_step_budget_lowers_it_and_its_drift_stops_growing_linearly():
    """Issue 48: each step asked for 1.5x the last (an honest island correcting against a flipped
    model, its steps growing with the distance). Left to grow, 60 steps are 1.5**60 = 3.7e10 times
    the first. Counted at their length, the steps the budget held raised it linearly; counted as
    the mean, they held it where it was and the fragment drifted linearly at that rate (every step
    after the warm-up at 2 x 2.03). A held step now counts at the mean x the factor it was held by,
    so the budget falls to its floor (its peak x 4 / steps) and the drift grows as the logarithm
    of the steps."""
    budget = StepBudget()
    asked, moved = 1.0, []
    for _ in range(600):
        scale = budget.scale(asked)
        moved.append(asked * scale)
        budget.record(moved[-1], scale=scale)
        asked = 1.5 * moved[-1]
    warm = (1.0 + 1.5 + 2.25 + 3.375) / 4  # the warm-up's four steps: every later step is held
    assert budget.cap() < 2.0 * warm / 100, budget.state_dict()
    held_at_the_old_budget = 2.0 * warm * (600 - 4)
    assert sum(moved[4:]) < held_at_the_old_budget / 10  # was every step at 2 x warm
    assert sum(moved[300:]) < sum(moved[4:300]) / 2  # the second half moves less than the first: not linear


def test_a_round_without_a_majority_moves_its_share_of_the_budget_and_does_not_set_it():
    """Two colluding islands of four open rounds of their own ahead of the clock (issue 48): such a
    round may move the fragment only its share (2 of 4: half) of the budget, and neither raises nor
    lowers it (one island's tiny or huge steps in rounds of its own would set the run's budget)."""
    budget = StepBudget()
    for _ in range(4):
        budget.record(1.0)
    assert budget.cap(share=0.5) == pytest.approx(0.5) and budget.cap(share=0.75) == pytest.approx(2.0)
    assert budget.scale(4.0, share=0.25) == pytest.approx(0.25 / 4.0)
    for norm in (0.0, 0.5, 100.0):
        budget.record(norm, share=0.5, scale=0.01)
    assert budget.cap() == pytest.approx(2.0) and budget.steps == 4


def test_a_step_its_entries_opposition_shortened_counts_at_the_length_they_stated_within_the_budget():
    budget = StepBudget()
    for _ in range(4):
        budget.record(1.0)
    budget.record(0.1, opposed=0.1)  # a tug-of-war's short step: said 1.0, as the others
    assert budget.cap() == pytest.approx(2.0)
    budget.record(0.5, opposed=0.01)  # its stated 50 counts as the budget at most (2.0), not more
    assert budget.cap() == pytest.approx(2.0 * (5.0 + 2.0) / 6)


def test_honest_steps_shrinking_or_ramping_up_linearly_are_left_alone():
    """An honest run's steps are largest early and shrink as it converges, or grow linearly while
    its learning rate warms up: neither is scaled down (a ramp from zero, x_n = a n after a mean of
    a n / 2, is the tightest: exactly at the budget)."""
    for steps in ([5.0 / math.sqrt(n) for n in range(1, 200)], [0.1 * n for n in range(1, 200)]):
        budget = StepBudget()
        for norm in steps:
            assert budget.scale(norm) == pytest.approx(1.0, rel=1e-12), (norm, budget.state_dict())
            budget.record(norm)


def test_the_step_budget_is_part_of_the_guards_checkpoint():
    guard = _guard()
    for norm in (3.0, 2.0, 1.0, 2.0, 2.0):
        guard.step_budget.record(norm)
    restored = _guard()
    restored.load_state_dict(guard.state_dict())
    assert restored.step_budget.cap() == guard.step_budget.cap() == pytest.approx(2.0 * 2.0)
    assert restored.step_budget.peak == guard.step_budget.peak
    assert restored.step_budget.scale(8.0) == pytest.approx(0.5)
    older = _guard()
    older.load_state_dict({k: v for k, v in guard.state_dict().items() if k != "step_budget"})
    assert older.step_budget.cap() is None  # a checkpoint from before the budget: it warms up again
    with pytest.raises(ValueError, match="finite mean"):
        older.load_state_dict({"step_budget": {"steps": 3, "mean": float("nan"), "measures": "movement"}})
    # a budget of merged outer gradients' lengths (before it bounded the movement) warms up again:
    # with outer momentum its mean, a fraction of a movement, would have held every honest step
    older.load_state_dict({"step_budget": {"steps": 40, "mean": 0.1}})
    assert older.step_budget.cap() is None


def test_an_entry_over_its_influence_budget_loses_its_pull_on_the_direction_too():
    """RDA takes the merged direction from the weights alone: an entry cut to a tenth of its
    length by its budget still pulled the direction with all its weight. Its weight is cut with it."""
    import torch

    from lightning_diloco.core.merge import merge_outer_gradients

    guard = _guard()
    for _ in range(4):
        guard.record_round({0: 1.0, 1: 4.0})  # island 1 has moved the fragment 4x island 0 already
    honest, hostile = torch.ones(100), -torch.ones(100)

    class E:
        def __init__(self, island, g, base_version):
            self.island, self.outer_gradient, self.base_version = island, g, base_version
            self.tokens, self.steps, self.norm = 400.0, 4, float(g.norm())

    # the honest entry is one version older (discounted 2:1 by its age), the hostile one is fresh
    bounded = guard.bound_round([E(0, honest, 9), E(1, hostile, 10)], fragment=torch.zeros(100), version=10,
                                staleness_discount=1.0)
    [step] = merge_outer_gradients([[g] for g in bounded.gradients], bounded.weights, ["dense"])
    assert float(step @ honest) > 0, bounded.weights  # before: the hostile direction, at the full radius
    assert bounded.shares[1] < bounded.shares[0]


def test_entries_that_oppose_each_other_shorten_the_step_and_agreeing_or_independent_ones_do_not():
    """RDA keeps the typical length however much the directions cancel: one flipped entry against
    one honest one made a whole step for the side with the slight edge in weight (issue 48)."""
    import torch

    g = torch.Generator().manual_seed(0)
    honest = torch.randn(10_000, generator=g)
    close = honest + 0.3 * torch.randn(10_000, generator=g)  # another honest island: the same way, its own noise
    noise = [torch.randn(10_000, generator=g) for _ in range(4)]  # independent directions (noise near a minimum)

    def scale(weights, gradients):
        return opposition_scale(weights, gradients, [float(x.norm()) for x in gradients])

    assert scale([1.0, 1.0], [honest, close]) == 1.0
    assert scale([1.0] * 4, noise) == 1.0 and scale([1.0, 3.0], noise[:2]) == 1.0
    assert scale([1.0], [-honest]) == 1.0  # alone: nothing to oppose
    flipped = -1.5 * close  # the flipper: the honest delta turned around, longer, with more weight
    assert scale([1.0, 1.4], [honest, flipped]) < 0.6
    assert scale([1.0, 1.0], [honest, -honest]) < 1e-6  # a tie: no step
    assert scale([1.0, 1.0, 0.0], [honest, -honest, honest]) < 1e-6  # an entry without weight takes no part
    assert scale([1e30, 1e30], [honest, close]) == 1.0  # weights past float32's square stay finite
    assert scale([1.0, 1.0], [honest, torch.zeros(10_000)]) == 1.0


def test_the_step_budget_bounds_the_fragments_movement_momentum_included():
    """With outer momentum a round whose entries the other bounds had cut to nothing still moved
    the fragment by the momentum, once in every round two colluding islands opened (issue 48):
    the budget bounds the movement, and a held step scales the momentum with it."""
    import torch

    from lightning_diloco.core.config import OuterConfig, RunConfig
    from lightning_diloco.core.state import FragmentState

    frag = FragmentState(torch.zeros(16), RunConfig(outer=OuterConfig(lr=0.7, momentum=0.9)))
    push = torch.ones(16)
    for _ in range(5):
        frag.apply(push)
    momentum = frag.outer.momentum_buffer.clone()
    before = frag.value.clone()
    lengths = []

    def half(length):
        lengths.append(length)
        return 0.5

    assert frag.apply(torch.zeros(16), bound=half) == 6  # nothing merged, yet the momentum moves it
    moved = float((frag.value - before).norm())
    assert lengths == [pytest.approx(0.7 * 0.9 * 0.9 * float(momentum.norm()), rel=1e-5)]  # Nesterov: lr mu^2 buf
    assert moved == pytest.approx(0.5 * lengths[0], rel=1e-5)
    assert torch.allclose(frag.outer.momentum_buffer, 0.5 * 0.9 * momentum)  # what was not taken is not carried on
    assert torch.equal(frag.history[6], frag.value)  # the version published is the value as bounded


def test_in_an_opposed_round_of_four_a_claimed_newer_base_or_bigger_counters_buy_no_weight():
    """Two entries claim the newest base and the most tokens, the two they oppose are a version
    older with honest counters (issue 48: two far-place flippers of four in every round of the
    grace window). The staleness discount halved the older entries and the counters were capped at
    1.4x, so the claimants weighed 2.8x each and their side took every step. In an opposed round
    each entry now weighs the round's lower median at most: the claims buy nothing, the two sides
    cancel, and the step is about nothing."""
    import torch

    from lightning_diloco.core.merge import merge_outer_gradients

    direction = torch.nn.functional.normalize(torch.ones(100), dim=0)

    class E:
        def __init__(self, island, g, base_version, tokens, steps):
            self.island, self.outer_gradient, self.base_version = island, g, base_version
            self.tokens, self.steps, self.norm = tokens, steps, float(g.norm())

    honest = [E(i, direction.clone(), 9, 400.0, 4) for i in (0, 1)]
    claimants = [E(i, -direction, 10, 1e15, 1) for i in (2, 3)]
    bounded = _guard().bound_round([*honest, *claimants], fragment=torch.zeros(100), version=10, staleness_discount=1.0)
    assert max(bounded.weights[2:]) <= min(bounded.weights[:2]), bounded.weights  # before: 2.8x each
    [step] = merge_outer_gradients([[g] for g in bounded.gradients], bounded.weights, ["dense"])
    assert float(step @ direction) > -1e-6, bounded.weights  # before: the claimants' whole step


def test_in_a_round_of_agreeing_entries_the_age_discount_still_applies():
    """Only an opposed round ignores the claimed base: agreeing entries, as honest islands' are,
    keep the staleness discount (honest runs merge as before)."""
    import torch

    class E:
        def __init__(self, island, base_version):
            self.island, self.base_version = island, base_version
            self.outer_gradient = torch.ones(100) + 0.01 * island
            self.tokens, self.steps, self.norm = 400.0, 4, float(self.outer_gradient.norm())

    bounded = _guard().bound_round([E(0, 9), E(1, 10), E(2, 10)], fragment=torch.zeros(100), version=10,
                                   staleness_discount=1.0)
    assert bounded.weights[0] == pytest.approx(bounded.weights[1] / 2)


def test_an_opposed_round_charges_influence_only_to_the_side_its_step_went():
    """In a tug-of-war the step goes one side's way; the other side moved the fragment nowhere it
    points. Charged at their whole shares, both sides of every opposed round spent influence alike
    and the budget never held the side that kept winning (issue 48: one flipper of two, 3.95x the
    one-honest distance at worst). Charged along the step (:func:`along_the_step`), the winner
    spends its share and the loser nothing, so the winner's next entries are the ones cut."""
    import torch

    class E:
        def __init__(self, island, g, base_version):
            self.island, self.outer_gradient, self.base_version = island, g, base_version
            self.tokens, self.steps, self.norm = 400.0, 4, float(g.norm())

    g = torch.Generator().manual_seed(0)
    honest = torch.randn(100, generator=g)
    flipped = -honest + 0.1 * torch.randn(100, generator=g)
    guard = _guard()
    # the flipped entry is fresh, the honest one a version older: the flipped side wins the round
    bounded = guard.bound_round([E(0, honest, 9), E(1, flipped, 10)], fragment=torch.zeros(100), version=10,
                                staleness_discount=1.0)
    assert bounded.shares[0] == 0.0 < bounded.shares[1], bounded.shares  # before: both charged, 1:2
    guard.record_round(bounded.shares)
    for _ in range(3):  # the same round again: the side that won is charged and cut until the other catches up
        bounded = guard.bound_round([E(0, honest, 9), E(1, flipped, 10)], fragment=torch.zeros(100), version=10,
                                    staleness_discount=1.0)
        guard.record_round(bounded.shares)
    totals = guard.influence.totals()
    assert totals[1] <= totals[0] + float(honest.norm()), totals  # level within one typical step

    from lightning_diloco.core.guard import along_the_step

    assert along_the_step([1.0, 1.0], [honest, -honest], [float(honest.norm())] * 2) == [0.0, 0.0]  # a tie: neither
    assert along_the_step([1.0, 0.0], [honest, -honest], [float(honest.norm())] * 2) == [pytest.approx(1.0), 0.0]
