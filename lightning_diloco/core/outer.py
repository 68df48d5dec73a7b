"""The outer optimizer: torch's SGD with Nesterov momentum, fed the merged outer gradient, or its
delayed form (docs/algorithm.md#outer-step)."""

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
    """One outer optimizer state over one global fragment (a flat fp32 tensor, updated in place).

    Nesterov (the paper's): buf = mu * buf + g; theta -= lr * (g + mu * buf), once per outer step,
    whatever the number of contributions merged into g (torch's SGD).

    Delayed Nesterov (``OuterConfig.delayed_nesterov``; Liu et al., arXiv 2401.09135): a round
    that merged k of the N islands taking part moves the fragment by lr * (k/N) * g at once, and
    the momentum is updated and applied once N contributions have come in, from their average
    (buf = mu * buf + mean g; theta -= lr * mu * buf). A round of every island is one Nesterov
    step; partial rounds (islands out of phase, slow or away) no longer each compound the
    momentum with one island's view.
    """

    def __init__(self, fragment: torch.Tensor, config: OuterConfig) -> None:
        assert fragment.dtype == torch.float32 and fragment.dim() == 1, f"{fragment.dtype=} {fragment.shape=}"
        self.fragment = fragment
        self.lr, self.mu = config.lr, config.momentum
        self.delayed = config.delayed_nesterov and config.momentum > 0
        self.optimizer = torch.optim.SGD(
            [fragment],
            lr=config.lr,
            momentum=config.momentum,
            nesterov=config.nesterov and config.momentum > 0,
        )
        self._buffer: torch.Tensor | None = None  # delayed: the momentum
        self._pending: torch.Tensor | None = None  # delayed: sum of share * g since the last momentum update
        self._pending_share = 0.0

    @torch.no_grad()
    def step(self, outer_gradient: torch.Tensor, share: float = 1.0) -> None:
        """One outer step with ``outer_gradient``, merged from a share ``share`` (in (0, 1]) of the
        islands taking part; only the delayed form reads the share."""
        assert outer_gradient.shape == self.fragment.shape, f"{outer_gradient.shape=} {self.fragment.shape=}"
        if not self.delayed:
            self.fragment.grad = outer_gradient.to(torch.float32)
            self.optimizer.step()
            self.fragment.grad = None
            return
        assert 0.0 < share <= 1.0, f"{share=}"
        g = outer_gradient.to(torch.float32)
        self.fragment.add_(g, alpha=-self.lr * share)
        self._pending = g * share if self._pending is None else self._pending.add_(g, alpha=share)
        self._pending_share += share
        if self._pending_share >= 1.0 - 1e-6:
            mean = self._pending.div_(self._pending_share)
            self._buffer = mean.clone() if self._buffer is None else self._buffer.mul_(self.mu).add_(mean)
            self.fragment.add_(self._buffer, alpha=-self.lr * self.mu)
            self._pending, self._pending_share = None, 0.0

    def state_dict(self) -> dict:
        """The momentum, and what the delayed form has gathered toward its next update (copies)."""
        momentum, pending = self.momentum_buffer, self._pending
        return {"momentum": None if momentum is None else momentum.clone(),
                "pending": None if pending is None else pending.clone(), "pending_share": self._pending_share}

    def load_state_dict(self, state: dict) -> None:
        self.momentum_buffer = state.get("momentum")
        pending = state.get("pending")
        self._pending = None if pending is None else pending.to(torch.float32).clone()
        self._pending_share = float(state.get("pending_share", 0.0)) if pending is not None else 0.0

    @property
    def momentum_buffer(self) -> torch.Tensor | None:
        if self.delayed:
            return self._buffer
        return self.optimizer.state.get(self.fragment, {}).get("momentum_buffer")

    @momentum_buffer.setter
    def momentum_buffer(self, value: torch.Tensor | None) -> None:
        if value is not None:
            assert value.shape == self.fragment.shape, f"{value.shape=} {self.fragment.shape=}"
        if self.delayed:
            self._buffer = None if value is None else value.to(torch.float32).clone()
        elif value is None:
            self.optimizer.state.pop(self.fragment, None)
        else:
            self.optimizer.state[self.fragment] = {"momentum_buffer": value.clone()}
