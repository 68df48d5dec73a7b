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
    """Models of a few tensors on CPU (the vision recipe's cpu-tiny): the library's defaults with
    fewer fragments (P cannot exceed the model's tensors)."""
    return config_with({"num_fragments": num_fragments})


def small_text_model(num_fragments: int = 8) -> RunConfig:
    """Small language models on CPU (the text recipes' cpu-tiny, cpu-tiny-moe and cpu-small):
    :func:`small_model` with plain averaging: outer lr 1, no outer momentum (the global fragment
    is the merged contributions' average), and ``apply="rebase"`` with ``rebase_keep=0.25``: the
    island keeps a quarter of the steps it took since its send on top of it (the eager update's
    1/M at M = 4).

    The share kept, simulated (main job, 3 seeds, benchmarks/RESULTS.md 2026-11-28): +5.1% of
    DDP's eval loss at 0.25 and at 0 (overwrite's value), +5.6% at 1 (all of it, the preset
    before); synchronous DiLoCo at the same H, P and M +4.2%.

    Measured against the outer Nesterov step with mix, M = 4, 3 seeds each (6 for the main job),
    real runs (benchmarks/RESULTS.md): the gap to DDP's eval loss goes from +6.9% to +6.0% at 0.13M
    parameters, +7.9% to +5.5% for the MoE, +5.8% to +5.2% at 0.85M, +6.8% to +4.0% for LitGPT,
    and narrows with islands started apart, slow or killed; the training loop never waits on the
    network. Not for the ViT (0.8 points of accuracy worse, simulated), nor measured beyond
    0.85M, where the paper's Nesterov step is the evidence (:func:`large_model`)."""
    return config_with({"outer_lr": 1.0, "outer_momentum": 0.0, "apply": "rebase", "rebase_keep": 0.25},
                       base=small_model(num_fragments))


def large_model(sync_every: int, num_fragments: int) -> RunConfig:
    """GPU sizes: longer rounds (H inner steps) over more fragments, otherwise the paper's settings
    (its apply rule included: mix is measured better only up to 0.85M parameters)."""
    return config_with({"sync_every": sync_every, "num_fragments": num_fragments}, base=paper())


def low_bandwidth(base: RunConfig | None = None) -> RunConfig:
    """The paper's byte reduction at H = 24: int2 both ways in blocks of 128 (error feedback both
    ways, as always), with the outer learning rate at 0.5 where the base has an outer momentum
    (the library's 0.7 with Nesterov momentum 0.9) and the base's outer step kept where it has
    none (plain averaging, :func:`small_text_model`).

    Measured on the text recipe (M = 4, 3 seeds each; benchmarks/RESULTS.md): on the library's
    defaults, half their bytes (about 240-250x DDP's, against their 124x) for 0.6% of DDP's eval
    loss more at cpu-tiny (0.13M parameters) and 0.1% less at cpu-small (0.85M), where int2 at the
    default outer lr cost 2.4%. On plain averaging the smaller step costs instead (simulated,
    cpu-tiny: +9.8% of DDP at outer lr 0.5 against +7.2% at 1, and +5.6% with int4). Both sizes
    are toys: check it on your model against its base before relying on it. With a synchronizer
    of its own the synchronizer's settings rule (an island warns of a conflict): start it with
    these (``--config``, a JSON file of ``low_bandwidth().to_dict()``)."""
    base = base if base is not None else RunConfig()
    changes: dict[str, object] = {"uplink_codec": "int2", "downlink_codec": "int2", "block_size": 128}
    if base.outer.momentum > 0:
        changes["outer_lr"] = 0.5  # damps the int2 error the momentum carries from round to round
    return config_with(changes, base=base)


def sparse(base: RunConfig | None = None, density: float = 1 / 64, dense_tensors: str = "") -> RunConfig:
    """SparseLoCo's encoding (arXiv 2508.15706) both ways: each chunk of 4096 values sends its
    ``density`` share of largest values as 2-bit levels with 12-bit indices (core/sparse_codec.py),
    what is left carried by error feedback (the island's residual on the uplink, the published
    chain on the downlink). About 19x fewer payload bytes than int4 at density 1/64 (1,317x fewer
    than DDP on the links, 1/128 1,763x); the outer step is the base's. ``dense_tensors``: the
    ``sparse_dense_tensors`` setting, tensors whose fragments go in int2 instead (a language
    model's output head, ``"*lm_head.weight"``: a top-k cannot keep up with it).

    It does not train to int4's quality here (simulated, cpu-tiny; benchmarks/RESULTS.md,
    2026-11-29): the sparse uplink is capacity-bound, the global model trailing the islands'
    progress by rounds. A sparse uplink at 1/16 costs +4.85% of int4's eval loss, +2.8% with
    the output head in int2, +1.2% with ``uplink_residual="parameters"`` too (4 seeds each, the
    text preset's plain averaging and rebase; not measured better elsewhere), and that arm at
    1/8 +0.47% (within half a point, +0.14% on the real main job; 1.40x fewer bytes than int4
    both ways on the links, 180x fewer than DDP); both ways at 1/64 the eval loss is 2.13 with
    the head in int2, 2.80 without (int4 1.84; one seed). With a synchronizer of its own, start
    it with these (``--config``)."""
    base = base if base is not None else RunConfig()
    return config_with({"uplink_codec": "sparse", "downlink_codec": "sparse", "sparse_density": density,
                        "uplink_feedback": True, "sparse_dense_tensors": dense_tensors}, base=base)
