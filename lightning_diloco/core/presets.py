"""Named run settings, as functions that return a validated :class:`RunConfig`.

The recipes, the benchmarks and users pick a preset by calling it; what a preset changes from
the library's defaults is ``changed_settings(preset())``.
"""

from __future__ import annotations

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.settings import config_with


def paper() -> RunConfig:
    """The paper's settings: the library's defaults (``core/config.py``) except the apply rule,
    which the paper has as ``overwrite`` and the library as ``mix`` (it trained better at both
    sizes measured on CPU; the paper's rule holds at the sizes the paper trained)."""
    return config_with({"apply": "overwrite"})


def small_model(num_fragments: int = 8) -> RunConfig:
    """Models of a few tensors on CPU (the recipes' cpu-tiny and cpu-small presets): the library's
    defaults with fewer fragments (P cannot exceed the model's tensors)."""
    return config_with({"num_fragments": num_fragments})


def large_model(sync_every: int, num_fragments: int) -> RunConfig:
    """GPU sizes: longer rounds (H inner steps) over more fragments, otherwise the paper's settings
    (its apply rule included: mix is measured better only up to 0.85M parameters)."""
    return config_with({"sync_every": sync_every, "num_fragments": num_fragments}, base=paper())
