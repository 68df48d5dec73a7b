"""Token-weighted merging of outer gradients (docs/algorithm.md#merging).

Each contribution m brings an outer gradient Delta_m = Theta_p - theta_m (one tensor per
parameter in the fragment) and a weight w_m = c_tok**2 / c_steps.

- embedding tensors: Delta = sum w_m Delta_m / sum w_m;
- dense tensors, radial-directional averaging (RDA):
  Delta = (sum w_m |Delta_m| / sum w_m) * normalize(sum w_m normalize(Delta_m)),
  with normalize(0) = 0 and norms taken per tensor. Unlike a plain mean, RDA keeps the typical
  step length when islands disagree in direction.

Norms have float64's range (:func:`norm64`): the fp32 norm of finite values overflows from about
1e19 per element, and no finite input may make a merge non-finite. How far one contribution can
move a merge is bounded in core/guard.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_diloco.core.fragments import EMBEDDING

NORM_PIECE = 1 << 18  # values per piece of norm64: each piece's squares (1 MB) stay in cache
SAFE_SQUARES = (1e-30, 1e30)  # a float32 sum of squares strictly inside this is neither overflowed nor underflowed
MAX_ALPHA = 1e37  # the largest factor an RDA sum adds a delta with: inside float32, with room for the sum


def common_scale(factors: Sequence[float]) -> float:
    """One scale for every factor of a float32 sum of vectors, so that none passes MAX_ALPHA:
    float32 factors end at 3.4e38 (1 / |delta| of a few subnormal values is 1e45). Scaling all
    alike keeps their ratios, so the sum's direction is unchanged; 1 when none is that large."""
    return min(1.0, MAX_ALPHA / max(factors)) if any(factors) else 1.0


def norm64(x: torch.Tensor) -> float:
    """The 2-norm of ``x``, with float64's range: finite for every finite input.

    Piece by piece: each piece's squares are summed in float32 (pairwise, relative error about
    1e-8 measured on 16M Gaussian values) and the pieces' sums in float64; a piece whose float32
    sum could have overflowed or underflowed is taken in float64 instead. ``vector_norm(x,
    dtype=float64)`` made a float64 copy of the whole tensor first: twice the fragment's size in
    fresh memory, 54 ms for a 16M-parameter fragment, against 4 ms here.
    """
    total = 0.0
    for piece in x.reshape(-1).split(NORM_PIECE):
        squares = float(torch.square(piece).sum())
        if not SAFE_SQUARES[0] < squares < SAFE_SQUARES[1]:  # also NaN, inf, and an all-zero piece
            squares = float(torch.linalg.vector_norm(piece, dtype=torch.float64)) ** 2
        total += squares
    return math.sqrt(total)


def contribution_weight(tokens: float, steps: int, *, age: int = 0, staleness_discount: float = 0.0) -> float:
    """w = tokens**2 / steps, divided by (1 + lambda * age) when the staleness discount is on.

    tokens**2 / steps = tokens x tokens-per-step: an island that did more work, with bigger
    batches, counts more.
    """
    if steps <= 0 or tokens < 0:
        raise ValueError(f"contribution counters must be tokens >= 0 and steps >= 1, got {tokens=} {steps=}")
    weight = tokens * tokens / steps
    if staleness_discount:
        weight /= 1.0 + staleness_discount * age
    return weight


def _output(deltas: Sequence[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.zeros_like(deltas[0], dtype=torch.float32)
    assert out.shape == deltas[0].shape, f"{out.shape=} {deltas[0].shape=}"
    return out.zero_()


def weighted_mean(deltas: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor | None = None) -> torch.Tensor:
    total = float(sum(weights))
    assert total > 0, f"{weights=}: at least one contribution must have a positive weight"
    out = _output(deltas, out)
    for delta, w in zip(deltas, weights):
        if w:
            out.add_(delta, alpha=w / total)
    return out


def radial_directional_average(
    deltas: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor | None = None
) -> torch.Tensor:
    total = float(sum(weights))
    assert total > 0, f"{weights=}: at least one contribution must have a positive weight"
    radius = 0.0
    direction = _output(deltas, out)
    norms = [norm64(delta) if w else 0.0 for delta, w in zip(deltas, weights)]
    alphas = [w / norm if norm > 0 else 0.0 for w, norm in zip(weights, norms)]
    # a delta of norm 1e-43 gave w / norm = 1e47 and the merge raised, on every close of its round
    scale = common_scale(alphas)
    for delta, w, norm, alpha in zip(deltas, weights, norms, alphas):
        radius += w * norm / total
        if alpha:
            direction.add_(delta, alpha=alpha * scale)
    direction_norm = norm64(direction)
    # normalize(0) = 0. Opposite islands cancel only up to rounding, and normalizing that residue
    # would point the full radius in a random direction, so a sum of unit vectors shorter than
    # 1e-6 of its largest possible length counts as zero.
    if direction_norm <= 1e-6 * total * scale:
        return direction.zero_()
    return direction.mul_(radius / direction_norm)


def merge_outer_gradients(
    contributions: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    roles: Sequence[str],
    method: str = "rda",
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Merge per-tensor outer gradients of several contributions into one per tensor.

    ``contributions[m][i]`` is island m's outer gradient for the fragment's tensor i, whose role
    is ``roles[i]``. ``method`` is ``rda`` (embedding tensors still use the weighted mean) or
    ``mean`` (weighted mean everywhere). ``out``, when given, receives the result (one tensor
    per role, e.g. views of one flat buffer).
    """
    assert len(contributions) == len(weights), f"{len(contributions)=} {len(weights)=}"
    assert all(len(c) == len(roles) for c in contributions), "every contribution must cover every tensor"
    if method not in ("rda", "mean"):
        raise ValueError(f"merge method {method!r} is not 'rda' or 'mean'")
    merged = []
    for i, role in enumerate(roles):
        per_tensor = [c[i] for c in contributions]
        target = None if out is None else out[i]
        if method == "rda" and role != EMBEDDING:
            merged.append(radial_directional_average(per_tensor, weights, target))
        else:
            merged.append(weighted_mean(per_tensor, weights, target))
    return merged

