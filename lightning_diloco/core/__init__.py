"""The Decoupled DiLoCo algorithm as pure functions and small classes (torch and stdlib only)."""

from lightning_diloco.core.codecs import Codec, get_codec
from lightning_diloco.core.config import CodecConfig, MergeConfig, OuterConfig, RunConfig, ScheduleConfig
from lightning_diloco.core.fragments import (
    FragmentLayout,
    TensorSpec,
    build_layout,
    canonical_name,
    tensor_specs,
    trainable_parameters,
)
from lightning_diloco.core.merge import contribution_weight, merge_outer_gradients
from lightning_diloco.core.quorum import Decision, RoundView, decide
from lightning_diloco.core.schedule import due_fragment, fragment_offsets
from lightning_diloco.core.state import SynchronizerState

__all__ = [
    "Codec",
    "CodecConfig",
    "Decision",
    "FragmentLayout",
    "MergeConfig",
    "OuterConfig",
    "RoundView",
    "RunConfig",
    "ScheduleConfig",
    "SynchronizerState",
    "TensorSpec",
    "build_layout",
    "canonical_name",
    "contribution_weight",
    "decide",
    "due_fragment",
    "fragment_offsets",
    "get_codec",
    "merge_outer_gradients",
    "tensor_specs",
    "trainable_parameters",
]
