"""Merging, written from the formulas of docs/algorithm.md#merging."""

import math

import pytest
import torch

from lightning_diloco.core.fragments import DENSE, EMBEDDING
from lightning_diloco.core.merge import (
    contribution_weight,
    merge_outer_gradients,
    norm64,
    radial_directional_average,
    weighted_mean,
)


def test_weight_is_tokens_squared_over_steps():
    assert contribution_weight(1000, 10) == 1000 * 1000 / 10
    assert contribution_weight(1000, 10, age=3, staleness_discount=0.5) == pytest.approx(1e5 / 2.5)


@pytest.mark.parametrize("tokens,steps", [(10, 0), (-1, 3)])
def test_absurd_counters_are_refused(tokens, steps):
    with pytest.raises(ValueError, match="counters"):
        contribution_weight(tokens, steps)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_rda_keeps_the_norm_of_orthogonal_equal_norm_inputs(m):
    deltas = [3.0 * torch.eye(m)[i] for i in range(m)]
    rda = radial_directional_average(deltas, [1.0] * m)
    mean = weighted_mean(deltas, [1.0] * m)
    assert float(rda.norm()) == pytest.approx(3.0)
    assert float(mean.norm()) == pytest.approx(3.0 / math.sqrt(m))  # a plain mean shrinks it


def test_single_learner_merge_is_its_own_outer_gradient():
    delta = [torch.randn(5, 3), torch.randn(7)]
    for method in ("rda", "mean"):
        merged = merge_outer_gradients([delta], [2.5], [DENSE, EMBEDDING], method)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(merged, delta))


def test_a_zero_weight_removes_a_learner():
    a, b = [torch.randn(10)], [torch.randn(10) * 100]
    for method in ("rda", "mean"):
        with_b = merge_outer_gradients([a, b], [1.0, 0.0], [DENSE], method)
        assert torch.allclose(with_b[0], a[0], atol=1e-6)


def test_embedding_tensors_use_the_weighted_mean_under_rda():
    a, b = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 4.0])
    merged = merge_outer_gradients([[a, a], [b, b]], [1.0, 3.0], [EMBEDDING, DENSE], "rda")
    assert torch.allclose(merged[0], (1 * a + 3 * b) / 4)
    # dense: radius (1*2 + 3*4)/4 = 3.5, direction normalize(1*(1,0) + 3*(0,1))
    direction = torch.tensor([1.0, 3.0]) / math.sqrt(10)
    assert torch.allclose(merged[1], 3.5 * direction)


def test_rda_norms_are_per_tensor():
    big, small = torch.tensor([100.0, 0.0]), torch.tensor([0.0, 0.01])
    merged = merge_outer_gradients([[big, small], [big, small]], [1.0, 1.0], [DENSE, DENSE], "rda")
    assert float(merged[0].norm()) == pytest.approx(100.0) and float(merged[1].norm()) == pytest.approx(0.01)


def test_opposite_inputs_cancel_to_zero_not_nan():
    d = torch.randn(6)
    out = radial_directional_average([d, -d], [1.0, 1.0])
    assert torch.equal(out, torch.zeros(6))


def test_all_zero_inputs_merge_to_zero():
    assert torch.equal(radial_directional_average([torch.zeros(4)] * 3, [1.0, 2.0, 3.0]), torch.zeros(4))


def test_weights_scale_the_radius_and_the_direction():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])
    out = radial_directional_average([a, b], [3.0, 1.0])
    radius = (3 * 1 + 1 * 3) / 4
    direction = torch.tensor([3.0, 1.0]) / math.sqrt(10)
    assert torch.allclose(out, radius * direction)




def test_rda_of_finite_but_huge_inputs_stays_finite():
    """fp32 norms overflow from about 1e19 per element; the merge takes them in float64."""
    huge = torch.full((1000,), 1e20)
    merged = radial_directional_average([huge, torch.full((1000,), 1e-3)], [1.0, 1.0])
    assert torch.isfinite(merged).all() and float(merged.norm()) > 0


@pytest.mark.parametrize("tiny, weight", [(1e-45, 1.0), (1e-30, 1e30)])
def test_rda_of_a_tiny_input_or_a_huge_weight_keeps_the_direction_of_the_unit_vectors(tiny, weight):
    """The sum of unit vectors was taken with factors w / |delta| in float32: a delta of a few
    subnormal values (|delta| 1e-43), or a weight of 1e30 (tokens 1e15, one step) on a short one,
    raised "cannot be converted to type float without overflow", on every close of the round."""
    a, b = torch.full((2,), tiny) * torch.tensor([1.0, 0.0]), torch.tensor([0.0, 3.0])
    out = radial_directional_average([a, b], [weight, weight])
    radius = (float(a.norm()) + 3.0) / 2  # equal weights: the mean length, half of the unit vectors each
    assert torch.allclose(out, radius * torch.tensor([1.0, 1.0]) / math.sqrt(2), rtol=1e-5)


@pytest.mark.parametrize("numel", [0, 5, (1 << 18) + 3, 3_000_000])
def test_norm64_is_the_float64_norm(numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 1e-3
    exact = float(torch.linalg.vector_norm(x, dtype=torch.float64))
    assert norm64(x) == pytest.approx(exact, rel=1e-7, abs=0.0)


def test_norm64_keeps_float64_range_for_huge_and_tiny_values_and_propagates_non_finite_ones():
    huge = torch.full((1 << 19,), 3e38)  # float32 squares overflow: the pieces are taken in float64
    assert norm64(huge) == pytest.approx(float(torch.linalg.vector_norm(huge, dtype=torch.float64)), rel=1e-9)
    tiny = torch.full((1000,), 1e-30)  # float32 squares underflow to 0
    assert 0 < norm64(tiny) == pytest.approx(float(torch.linalg.vector_norm(tiny, dtype=torch.float64)), rel=1e-9)
    assert math.isnan(norm64(torch.tensor([1.0, float("nan")]))) and norm64(torch.tensor([1.0, float("inf")])) == float("inf")
