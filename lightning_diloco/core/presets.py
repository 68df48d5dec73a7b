"""Named run settings, as functions that return a validated :class:`RunConfig`.

The recipes, the benchmarks and users pick a preset by calling it; what a preset changes from
the library's defaults is ``changed_settings(preset())``.
"""

from __future__ import annotations

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.settings import config_with


def paper() -> RunConfig:
    """The paper's settings, which are the library's defaults (``core/config.py``)."""
    return RunConfig()


def small_model(num_fragments: int = 8) -> RunConfig:
    """Models of a few tensors on CPU (the recipes' cpu-tiny presets): the paper's settings with
    fewer fragments (P cannot exceed the model's tensors) and islands mixing the global fragment
    into their own, the best arm of ``benchmarks.rounds`` at this size (benchmarks/RESULTS.md)."""
    return config_with({"num_fragments": num_fragments, "apply": "mix"})


def large_model(sync_every: int, num_fragments: int) -> RunConfig:
    """GPU sizes: longer rounds (H inner steps) over more fragments, otherwise the paper's settings."""
    return config_with({"sync_every": sync_every, "num_fragments": num_fragments})
