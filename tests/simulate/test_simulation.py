"""The simulator (lightning_diloco/simulate) against the real system and a hand-written DiLoCo
loop, and its reproducibility."""

from __future__ import annotations

import pytest
import torch

from lightning_diloco.core.settings import config_with
from lightning_diloco.simulate.run import IslandPlan, Simulation


class Regression:
    """An inner loop: a tiny MLP on a fixed regression task, its AdamW, batches in a fixed order."""

    def __init__(self, island: int, batches: int = 16, batch: int = 16) -> None:
        from tests.learner.models import TinyRegressor, regression_data

        self.model = TinyRegressor()
        self.optimizer = self.model.configure_optimizers()
        data = regression_data(seed=island)
        self.batches = [data[k * batch:(k + 1) * batch] for k in range(batches)]
        self.index = 0

    def step(self) -> float:
        x, y = self.batches[self.index % len(self.batches)]
        loss = self.model.training_step((x, y), self.index)
        self.index += 1
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(x.shape[0])


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_one_island_reproduces_the_real_strategy_run_golden():
    """The golden of a real Lightning run (tests/goldens, strategy_run: 48 steps, H 4, P 2, tau 0,
    int4 both ways, embedded synchronizer) comes out of the simulator as well: the same island
    code and service, with the clock and links replaced."""
    from tests.goldens import check_golden

    loops = []

    def make(i):
        loops.append(Regression(0))
        return loops[-1]

    config = config_with({"sync_every": 4, "num_fragments": 2, "overlap_steps": 0})
    result = Simulation(config, make, [IslandPlan()], steps=48).run()
    assert len(loops[0].model.losses) == 48
    check_golden("strategy_run", {"losses": loops[0].model.losses[::4], "final_weights": flat(result.global_model)},
                 rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overlap, synchronous_steps", [(0, 0), (1, 24)], ids=["tau-0", "tau-1-synchronous-warm-start"])
def test_synchronous_islands_equal_a_hand_written_diloco_loop(overlap, synchronous_steps):
    """With no delays, islands in phase, quorum M, tau 0, one fragment, exact codecs, a plain mean
    and no bounds, the simulator's global model after N outer steps is plain DiLoCo's:
    every island trains H steps from the global model, the outer gradient is the mean of
    (global - local), and the outer optimizer is Nesterov SGD. Overlapping islands (tau 1) are
    synchronous DiLoCo as long as their synchronous warm start lasts, here the whole run."""
    M, H, rounds = 2, 4, 6
    settings = {"sync_every": H, "num_fragments": 1, "overlap_steps": overlap, "synchronous_steps": synchronous_steps,
                "min_quorum": M, "uplink_codec": "fp32", "downlink_codec": "fp32", "merge": "mean",
                "outlier_z": 0.0, "apply": "overwrite"}
    config = config_with(settings)
    result = Simulation(config, lambda i: Regression(i), [IslandPlan() for _ in range(M)], steps=H * rounds).run()
    assert result.outer_steps == rounds and result.per_outer_step == M

    loops = [Regression(i) for i in range(M)]
    theta = flat(loops[0].model).clone()
    outer = torch.optim.SGD([theta], lr=config.outer.lr, momentum=config.outer.momentum, nesterov=True)
    for _ in range(rounds):
        deltas = []
        for loop in loops:
            with torch.no_grad():  # a copy: vector_to_parameters would share theta's memory
                torch.nn.utils.vector_to_parameters(theta.detach().clone(), loop.model.parameters())
            for _ in range(H):
                loop.step()
            deltas.append(theta - flat(loop.model))
        theta.grad = torch.stack(deltas).mean(0)
        outer.step()
    torch.testing.assert_close(flat(result.global_model), theta.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("overlap, apply", [(1, "overwrite"), (1, "rebase"), (2, "rebase")])
def test_overlapping_islands_equal_a_hand_written_streaming_diloco_loop(overlap, apply):
    """Streaming DiLoCo with overlap, written out by hand (two fragments, each due at its own offset
    in the H steps; its outer step taken from the islands' progress since the global value they
    last applied; that global value applied tau steps after the send, overwriting the fragment
    or keeping the progress since the send on top of it, rebase): the simulator's global model is
    this loop's bit for bit. So what overlap costs in a simulated run (docs/recipes.md) is the
    algorithm's, not the island's bookkeeping."""
    from lightning_diloco.core.fragments import build_layout, tensor_specs
    from lightning_diloco.core.schedule import due_fragment, fragment_offsets

    M, H, P, rounds = 2, 4, 2, 6
    config = config_with({"sync_every": H, "num_fragments": P, "overlap_steps": overlap, "min_quorum": M,
                          "uplink_codec": "fp32", "downlink_codec": "fp32", "merge": "mean", "outlier_z": 0.0,
                          "apply": apply, "rebase_keep": 1.0})
    result = Simulation(config, lambda i: Regression(i), [IslandPlan() for _ in range(M)], steps=H * rounds).run()
    assert result.outer_steps == P * rounds

    loops = [Regression(i) for i in range(M)]
    members = build_layout(tensor_specs(loops[0].model), P).fragments
    params = [list(loop.model.parameters()) for loop in loops]
    with torch.no_grad():
        for ps in params[1:]:  # every island starts from the global model
            for p, p0 in zip(ps, params[0]):
                p.copy_(p0)
    theta = [p.detach().clone() for p in params[0]]
    base = [t.clone() for t in theta]
    outer = [torch.optim.SGD([theta[i] for i in members[f]], lr=config.outer.lr, momentum=config.outer.momentum,
                             nesterov=True) for f in range(P)]
    in_flight: dict[int, tuple[int, list[dict[int, torch.Tensor]]]] = {}  # fragment -> (apply step, snapshots)
    offsets = fragment_offsets(P, H)
    for step in range(1, H * rounds + 1):
        for loop in loops:
            loop.step()
        for f, (apply_at, snapshots) in list(in_flight.items()):
            if step >= apply_at:
                with torch.no_grad():
                    for ps, snapshot in zip(params, snapshots):
                        for i in members[f]:
                            ps[i].copy_(theta[i] + (ps[i] - snapshot[i] if apply == "rebase" else 0))
                for i in members[f]:
                    base[i] = theta[i].clone()
                del in_flight[f]
        f = due_fragment(step, offsets, H)
        if f is not None:
            snapshots = [{i: ps[i].detach().clone() for i in members[f]} for ps in params]
            for i in members[f]:
                theta[i].grad = torch.stack([base[i] - snapshot[i] for snapshot in snapshots]).mean(0)
            outer[f].step()
            in_flight[f] = (step + overlap, snapshots)
    torch.testing.assert_close(flat(result.global_model), torch.cat([t.flatten() for t in theta]), rtol=0, atol=0)


def test_the_synchronous_warm_start_ends_at_its_step():
    """Islands that overlap (tau 1) after a synchronous warm start of two rounds: the first two
    global versions are synchronous DiLoCo's (the same as a run synchronous throughout), and the
    rest differ from it, as they do in a run with no warm start from the first round on."""
    M, H, rounds = 2, 4, 6
    base = {"sync_every": H, "num_fragments": 1, "min_quorum": M, "uplink_codec": "fp32", "downlink_codec": "fp32",
            "merge": "mean", "outlier_z": 0.0, "apply": "overwrite"}

    def run(steps: int, **settings) -> torch.Tensor:
        config = config_with({**base, **settings})
        return flat(Simulation(config, lambda i: Regression(i), [IslandPlan() for _ in range(M)], steps=steps).run().global_model)

    synchronous = run(2 * H, overlap_steps=0)
    assert torch.equal(run(2 * H, overlap_steps=1, synchronous_steps=2 * H), synchronous)
    assert not torch.equal(run(2 * H, overlap_steps=1), synchronous), "without the warm start tau 1 differs at once"
    assert not torch.equal(run(H * rounds, overlap_steps=1, synchronous_steps=2 * H), run(H * rounds, overlap_steps=0))


def _eventful_run():
    plans = [IslandPlan(step_time=0.1, jitter=0.3, uplink_latency=0.05, downlink_latency=0.02),
             IslandPlan(step_time=0.13, start=0.4, jitter=0.3),
             IslandPlan(step_time=0.1, jitter=0.3, failures=((3.0, 1.5),))]
    # the paper's grace window, so that some contributions are merged a round late (today's
    # window, over the fragment's round, leaves none late here)
    config = config_with({"sync_every": 8, "num_fragments": 2, "grace_slack": "overlap"})
    return Simulation(config, lambda i: Regression(i), plans, steps=64).run()


def test_one_seed_reproduces_a_run_exactly():
    """Jittered steps, link delays, a late start, a failure and a restart: two runs with the same
    inputs agree bit for bit (the global model, every count), and the events did happen."""
    first, second = _eventful_run(), _eventful_run()
    assert torch.equal(flat(first.global_model), flat(second.global_model))
    counts = ("virtual_s", "outer_steps", "contributions", "late", "superseded", "clipped", "skipped", "restarts", "steps")
    assert [getattr(first, c) for c in counts] == [getattr(second, c) for c in counts]
    assert first.restarts == 1 and first.steps == [64, 64, 64]
    assert first.late > 0, "jitter and a restart put some contributions a round late"


@pytest.mark.parametrize(("grace_slack", "late_when_apart"), [("overlap", True), ("round", False)])
def test_an_island_that_sets_up_faster_runs_ahead_and_opens_the_rounds(grace_slack, late_when_apart):
    """Two islands join together; one takes its first step 1 s (10 steps) after the other. Both
    start at the run's clock, so the first stays 10 steps ahead and opens every round. With the
    paper's window (0.1 s) the other's sends miss them; over the fragment's round (0.8 s from the
    send, 1.6 s from the due step: the lead rule) they make them. Islands set up alike: none late.
    (At 1.5 s the first round, which waits for a second island's entry since no peer bounds a lone
    one, lined the islands' sends up round for round: none late either way.)"""
    config = config_with({"sync_every": 16, "num_fragments": 2, "grace_slack": grace_slack})

    def run(setup: float):
        plans = [IslandPlan(step_time=0.1), IslandPlan(step_time=0.1, setup=setup)]
        return Simulation(config, lambda i: Regression(i), plans, steps=96).run()

    together, apart = run(0.0), run(1.0)
    assert together.late == 0
    assert apart.virtual_s >= together.virtual_s + 1.0 - 1e-6, "the later island's steps start after its set-up"
    if late_when_apart:
        assert apart.late_share > 0.3, "the rounds closed before the second island's sends"
    else:
        assert apart.late == 0 and apart.per_outer_step > 1.5, "each round waited for the second island's send"


@pytest.mark.parametrize(("plan", "message"), [
    (dict(step_time=0.0), "step_time=0.0"),
    (dict(failures=((-1.0, 2.0),)), "failure (-1.0, 2.0)"),
    (dict(jitter=-0.1), "jitter=-0.1"),
    (dict(setup=-1.0), "setup=-1.0"),
])
def test_bad_plans_are_refused_naming_the_value(plan, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        IslandPlan(**plan)


def test_a_quorum_above_the_islands_is_refused():
    with pytest.raises(ValueError, match="min_quorum=3 exceeds the 2 islands"):
        Simulation(config_with({"min_quorum": 3}), lambda i: Regression(i), [IslandPlan(), IslandPlan()], steps=8)


def test_the_recipes_default_setups_spread_as_real_islands_and_follow_the_seed():
    """recipes.simulate's islands set up in different times by default (the real main job's first
    steps spread over up to 0.7 s), drawn per run seed: one seed repeats its start order."""
    from recipes.simulate import SETUP_SPREAD, real_setups

    first, other = real_setups(4, seed=0), real_setups(4, seed=1)
    assert first == real_setups(4, seed=0) and first != other
    assert all(0.0 <= t < SETUP_SPREAD for t in first + other)
    assert max(first) - min(first) > 0.1, "islands that join together step apart"


def test_sparse_dense_tensors_send_the_named_tensors_fragment_whole():
    """With a sparse uplink, ``sparse_dense_tensors`` sends the fragment of the named tensor in
    int4: after one round of one island the global value of that fragment moved in (almost) every
    value, the other fragment in no more than the top-k a chunk the density allows."""
    settings = {"sync_every": 4, "num_fragments": 2, "overlap_steps": 0, "uplink_codec": "sparse",
                "sparse_density": 1 / 16, "downlink_codec": "fp32", "merge": "mean", "outlier_z": 0.0,
                "apply": "overwrite", "outer_lr": 1.0, "outer_momentum": 0.0}
    start = {name: p.detach().clone() for name, p in Regression(0).model.named_parameters()}

    def moved(dense_tensors: str) -> dict[str, int]:
        config = config_with({**settings, "sparse_dense_tensors": dense_tensors})
        result = Simulation(config, lambda i: Regression(i), [IslandPlan()], steps=4).run()
        return {name: int((p.detach() != start[name]).sum()) for name, p in result.global_model.named_parameters()}

    sparse, mixed = moved(""), moved("net.0.w*")
    # two fragments: net.0.weight (128 values), and net.0.bias with the second layer (33 values)
    head = ("net.0.weight",)
    rest = ("net.0.bias", "net.2.weight", "net.2.bias")
    assert sum(sparse[t] for t in head) <= 128 // 16 and sum(sparse[t] for t in rest) <= round(33 / 16)
    assert sum(mixed[t] for t in head) >= 0.9 * 128  # its fragment whole, in int4
    assert sum(mixed[t] for t in rest) <= round(33 / 16)  # the other one still sparse


@pytest.mark.parametrize("pattern, message", [
    ("lm_head.*", r"'lm_head\.\*' matches no tensor of the model; its tensors are net\.0\.weight"),
    ("2.weight", r"'2\.weight' matches no tensor of the model; did you mean '\*\.2\.weight' \(net\.2\.weight\)\?"),
], ids=["unknown", "without-its-prefix"])
def test_a_dense_tensor_pattern_that_matches_nothing_is_refused_naming_the_tensors(pattern, message):
    config = config_with({"uplink_codec": "sparse", "sparse_dense_tensors": pattern, "sync_every": 4,
                          "num_fragments": 2})
    with pytest.raises(ValueError, match=message):
        Simulation(config, lambda i: Regression(i), [IslandPlan()], steps=4).run()
