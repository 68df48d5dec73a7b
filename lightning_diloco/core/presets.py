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


def low_bandwidth(base: RunConfig | None = None) -> RunConfig:
    """The paper's byte reduction at H = 24: int2 both ways in blocks of 128 (error feedback both
    ways, as always) with the outer learning rate at 0.5 instead of 0.7.

    Measured on the text recipe at two sizes (M = 4, 3 seeds each; benchmarks/RESULTS.md): half
    the default's bytes (about 240-250x DDP's, against the default's 124x) for 0.6% of DDP's eval
    loss more than the defaults at cpu-tiny (0.13M parameters) and 0.1% less at cpu-small (0.85M),
    where int2 at the default outer lr cost 2.4%. Both sizes are toys: check it on your model
    against the defaults before relying on it. With a synchronizer of its own the synchronizer's
    settings rule (an island warns of a conflict): start it with these (``--config``, a JSON file
    of ``low_bandwidth().to_dict()``)."""
    return config_with({"uplink_codec": "int2", "downlink_codec": "int2", "block_size": 128, "outer_lr": 0.5}, base=base)
