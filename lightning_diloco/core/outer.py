"""The outer optimizer: torch's SGD with Nesterov momentum, fed the merged outer gradient."""

from __future__ import annotations

import torch

from lightning_diloco.core.config import OuterConfig


def island_delta(local: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """What an island sends for a fragment: its progress since the global version it holds,
    ``local - base`` (encoded by the uplink codec). :func:`outer_gradient` turns it around."""
    return local - base


def outer_gradient(delta: torch.Tensor) -> torch.Tensor:
    """Delta_m = Theta_base - theta_m = -delta, measured against the island's own base. Overwrites
    ``delta``.

    Why its own base and not the current global value (the paper's Theta_p - theta_m): the two
    agree when the base is current, but for a base that is ``age`` versions old the current value
    adds -(Theta_now - Theta_base), which undoes the rounds the island missed; with outer momentum
    that feedback diverged with quorum 1 and islands out of phase (measured). Measured
    against its own base a late contribution adds only its own progress, and the round discounts
    it by its age.
    """
    return delta.neg_()


class OuterOptimizer:
    """One SGD state over one global fragment (a flat fp32 tensor, updated in place)."""

    def __init__(self, fragment: torch.Tensor, config: OuterConfig) -> None:
        assert fragment.dtype == torch.float32 and fragment.dim() == 1, f"{fragment.dtype=} {fragment.shape=}"
        self.fragment = fragment
        self.optimizer = torch.optim.SGD(
            [fragment],
            lr=config.lr,
            momentum=config.momentum,
            nesterov=config.nesterov and config.momentum > 0,
        )

    @torch.no_grad()
    def step(self, outer_gradient: torch.Tensor) -> None:
        assert outer_gradient.shape == self.fragment.shape, f"{outer_gradient.shape=} {self.fragment.shape=}"
        self.fragment.grad = outer_gradient.to(torch.float32)
        self.optimizer.step()
        self.fragment.grad = None

    @property
    def momentum_buffer(self) -> torch.Tensor | None:
        return self.optimizer.state.get(self.fragment, {}).get("momentum_buffer")

    @momentum_buffer.setter
    def momentum_buffer(self, value: torch.Tensor | None) -> None:
        if value is None:
            self.optimizer.state.pop(self.fragment, None)
        else:
            assert value.shape == self.fragment.shape, f"{value.shape=} {self.fragment.shape=}"
            self.optimizer.state[self.fragment] = {"momentum_buffer": value.clone()}
