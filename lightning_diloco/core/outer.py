"""The outer optimizer: torch's SGD with Nesterov momentum, fed the merged outer gradient."""

from __future__ import annotations

import torch

from lightning_diloco.core.config import OuterConfig


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
