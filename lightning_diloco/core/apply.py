"""How an island takes a new global fragment into its local one (docs/algorithm.md#applying-a-global-fragment).

Pure functions over flat fp32 fragments. ``reference`` is the point the island's local progress
is measured from: the snapshot it sent when the new version closes the round of that send, else
the global version it last applied (nothing of its progress since then was sent, or what was sent
is still waiting in a round).

- ``overwrite`` (paper): the global fragment replaces the local one; the island's progress since
  ``reference`` is dropped (what was sent is in the global model or in a round).
- ``mix`` (Streaming DiLoCo): alpha * local + (1 - alpha) * global.
- ``rebase``: global + keep * (local - reference): the progress not yet merged (a share ``keep`` of
  it, kappa) is kept on top of the new global value.
"""

from __future__ import annotations

import torch

from lightning_diloco.core.config import APPLY_MODES


def apply_global(mode: str, local: torch.Tensor | None, new_global: torch.Tensor, reference: torch.Tensor | None = None,
                 *, alpha: float = 0.5, keep: float = 1.0) -> torch.Tensor:
    """The island's new local fragment. ``local`` may be consumed, and the result can share memory
    with ``local`` or ``new_global``: copy it before changing it. ``local`` may be None where
    :func:`reads_local` says the mode does not need it."""
    if mode == "overwrite":
        return new_global
    assert local is not None, f"apply mode {mode!r} needs the local fragment"
    if mode == "mix":
        return local.mul_(alpha).add_(new_global, alpha=1.0 - alpha)
    if mode == "rebase":
        assert reference is not None, "rebase needs the reference the local progress is measured from"
        local = local.sub_(reference)
        return (local if keep == 1.0 else local.mul_(keep)).add_(new_global)
    raise ValueError(f"apply mode {mode!r} is not one of {', '.join(APPLY_MODES)}")


def reads_local(mode: str) -> bool:
    """Whether the new local fragment depends on the local one: overwrite's does not, so an island
    need not read its parameters to apply one (a copy of the fragment saved on the training thread)."""
    return mode != "overwrite"


def reads_reference(mode: str) -> bool:
    """Whether the new local fragment depends on ``reference``: only rebase's does."""
    return mode == "rebase"


def keeps_counters(mode: str) -> bool:
    """Whether the island's token and step counters survive an apply: only rebase keeps the
    progress they count; overwrite and mix start the fragment's count again."""
    return mode == "rebase"
