"""Run settings: one keyword-only dataclass per component, validated on construction.

Every refusal names the field, the value and how to fix it. ``RunConfig`` is what the
synchronizer hands an island on join, so it round-trips through plain dicts (JSON-safe).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

# Literal types give each choice setting its choices once: validation, flags and help read them.
Codec = Literal["fp32", "bf16", "int8", "int4", "int2", "sparse"]
MergeMethod = Literal["rda", "mean"]
ApplyMode = Literal["overwrite", "mix", "rebase"]
GraceSlack = Literal["round", "overlap"]
ResidualHome = Literal["push", "parameters"]
CODECS: tuple[str, ...] = get_args(Codec)
RESIDUAL_HOMES: tuple[str, ...] = get_args(ResidualHome)
MERGE_METHODS: tuple[str, ...] = get_args(MergeMethod)
APPLY_MODES: tuple[str, ...] = get_args(ApplyMode)
GRACE_SLACKS: tuple[str, ...] = get_args(GraceSlack)


MAX_BLOCK_SIZE = 1 << 16
"""The largest ``block_size``: values sharing one scale in int8/int4/int2."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{name}={value!r} is not one of {', '.join(map(repr, choices))}; pick one of those")


@dataclass(kw_only=True, frozen=True)
class ScheduleConfig:
    """When each fragment is sent and when the reply is applied (learner side)."""

    num_fragments: int = 24
    """P: fragments the parameters are packed into. More fragments spread traffic evenly over
    the H steps (one fragment per step at P = H); P = 1 is classic DiLoCo."""
    sync_every: int = 24
    """H, in inner steps: each fragment is sent once every H steps. Larger H means fewer bytes
    per token and more drift between islands."""
    overlap_steps: int = 2
    """tau, in inner steps: the new global fragment is applied tau steps after it was sent (or
    the first later step at which it has arrived). 0 waits for it in the same step: synchronous
    DiLoCo. Larger tau hides more latency but applies an older global fragment."""
    synchronous_steps: int = 0
    """Inner steps, on the run's clock, at the start of the run in which the islands apply each
    merge at its send and wait for its round (tau 0: synchronous DiLoCo) before they overlap by
    ``overlap_steps``: a synchronous warm start. One step of delay costs most while the model
    changes fastest (docs/algorithm.md#the-learner). 0: overlap from the first step."""
    apply: ApplyMode = "mix"
    """How a received global fragment meets the local one: ``mix`` (alpha * local + (1 - alpha)
    * global, Streaming DiLoCo's rule), ``overwrite`` (the paper's rule: the global fragment
    replaces the local one), or ``rebase`` (global plus the local progress made since the
    snapshot was taken). ``mix`` is the default because it trained better than ``overwrite`` at
    both model sizes measured, islands out of phase and quorum 1 (``benchmarks.rounds``,
    docs/algorithm.md#applying-a-global-fragment); ``presets.paper()`` keeps the paper's rule."""
    mix_alpha: float = 0.5
    """alpha for ``apply='mix'``, in [0, 1): the weight kept by the local fragment."""
    rebase_keep: float = 1.0
    """kappa for ``apply='rebase'``, in [0, 1]: the share of the island's progress since its send
    kept on top of the global fragment of that send's round, theta <- Theta_new + kappa * (theta -
    theta_at_send). 1 keeps it all (rebase); 0 keeps none (the value ``overwrite`` gives); 1/M is
    the eager update's share (Kale et al., arXiv 2502.12996). Progress on top of a version that
    is not its round's (its send still waits in a round) is always kept whole."""

    def __post_init__(self) -> None:
        _check(self.num_fragments >= 1, f"num_fragments={self.num_fragments} must be >= 1; use 1 for classic DiLoCo")
        _check(self.sync_every >= 1, f"sync_every={self.sync_every} must be >= 1 inner step")
        _check(
            self.num_fragments <= self.sync_every,
            f"num_fragments={self.num_fragments} exceeds sync_every={self.sync_every}: two fragments would be "
            "due on the same step; lower num_fragments or raise sync_every",
        )
        _check(
            0 <= self.overlap_steps < self.sync_every,
            f"overlap_steps={self.overlap_steps} must be in [0, sync_every={self.sync_every}); a fragment must "
            "land before it is due again",
        )
        _check(self.synchronous_steps >= 0, f"synchronous_steps={self.synchronous_steps} must be >= 0 inner steps")
        _check_choice("apply", self.apply, APPLY_MODES)
        _check(0.0 <= self.mix_alpha < 1.0, f"mix_alpha={self.mix_alpha} must be in [0, 1)")
        _check(0.0 <= self.rebase_keep <= 1.0, f"rebase_keep={self.rebase_keep} must be in [0, 1]: the share of the progress kept")


@dataclass(kw_only=True, frozen=True)
class MergeConfig:
    """How the synchronizer closes a round and merges what arrived."""

    method: MergeMethod = "rda"
    """``rda``: radial-directional averaging for dense tensors (paper); ``mean``: plain weighted
    mean for every tensor. Embedding tensors always use the weighted mean."""
    min_quorum: int = 1
    """K: distinct islands that must contribute before a round may close. With fewer islands
    alive the round waits while the islands keep training locally."""
    grace_gamma: float = 0.5
    """gamma in [0, 1): after quorum, wait at most gamma * max(0, slack * step_time -
    time_to_quorum - sync_time) for more islands (``grace_slack`` says what the slack is). 0 closes
    at quorum; a round closes at once when every live island has sent for it."""
    grace_slack: GraceSlack = "round"
    """The steps the grace window is a fraction of. ``round``: H, the steps until the fragment is
    due again; islands that overlap (tau >= 1) never wait for a round (a late version is applied
    when it comes), so a longer wait only makes the apply later, while a contribution that misses
    its round is merged a round late (simulated, 4 islands with jittered steps: 72% merged late
    and +8.9% of DDP's eval loss with ``overlap``, 0% and +6.2% with ``round``; docs/recipes.md).
    ``overlap``: tau, the paper's rule (the slack before an island needs the reply). With tau = 0
    the islands wait for their round, so both are 0: the round closes at quorum."""
    history: int = 4
    """S: versions of each fragment an island may hold and still be sent the next one as a lossy
    downlink's steps; one holding an older version gets the full value (with the fp32 downlink
    every island does: core/state.py). Synchronizer memory: with the fp32 downlink two copies
    of the model (the exact value and the one sent whole); with a lossy one, two (the exact current version
    and the value the islands hold, core/downlink.py) and S - 1 encoded steps (int4: about 1/7.5
    of a copy each, bf16 1/2)."""
    staleness_discount: float = 1.0
    """lambda >= 0: a contribution whose base is ``age`` versions old (it missed a round and is
    merged into the next one) weighs w / (1 + lambda * age). 0 disables the discount."""
    outlier_z: float = 10.0
    """z: an outer gradient longer than z x the reference norm (the lower median of the other
    contributions in the round and of each island's recent norms; core/guard.py) is scaled down
    to that length. Bounds what one bad or hostile island can do to a round; 0 disables it."""
    outlier_window: int = 16
    """Recent merged contributions per island whose median is that island's vote in the reference."""

    def __post_init__(self) -> None:
        _check_choice("method", self.method, MERGE_METHODS)
        _check(self.min_quorum >= 1, f"min_quorum={self.min_quorum} must be >= 1")
        _check(0.0 <= self.grace_gamma < 1.0, f"grace_gamma={self.grace_gamma} must be in [0, 1)")
        _check_choice("grace_slack", self.grace_slack, GRACE_SLACKS)
        _check(self.history >= 1, f"history={self.history} must keep at least the current version (>= 1)")
        _check(
            math.isfinite(self.staleness_discount) and self.staleness_discount >= 0.0,
            f"staleness_discount={self.staleness_discount} must be a finite number >= 0",
        )
        _check(
            self.outlier_z == 0.0 or self.outlier_z > 1.0,
            f"outlier_z={self.outlier_z} must be 0 (off) or > 1; a bound at or below the reference cuts honest islands short",
        )
        _check(self.outlier_window >= 3, f"outlier_window={self.outlier_window} must be >= 3 norms")


@dataclass(kw_only=True, frozen=True)
class OuterConfig:
    """The outer optimizer: SGD with Nesterov momentum, one state per fragment."""

    lr: float = 0.7
    """Outer learning rate (paper 0.7). 1.0 with momentum 0 is plain parameter averaging."""
    momentum: float = 0.9
    """Outer momentum in [0, 1) (paper 0.9)."""
    nesterov: bool = True
    """Nesterov momentum (paper). Ignored when momentum is 0."""
    delayed_nesterov: bool = False
    """Delayed Nesterov (Liu et al., arXiv 2401.09135): a round merging k of the N islands taking
    part moves the fragment by lr * k/N of its outer gradient, and the momentum is updated and
    applied once per N contributions, from their average. Equal to the Nesterov step when every
    round holds every island. Ignored when momentum is 0."""

    def __post_init__(self) -> None:
        _check(math.isfinite(self.lr) and self.lr > 0, f"outer lr={self.lr} must be a positive finite number")
        _check(0.0 <= self.momentum < 1.0, f"outer momentum={self.momentum} must be in [0, 1)")


@dataclass(kw_only=True, frozen=True)
class CodecConfig:
    """Wire encodings, chosen separately for each direction."""

    uplink: Codec = "int4"
    """Encoding of island -> synchronizer fragment deltas. int4 is near-lossless per the paper."""
    downlink: Codec = "int4"
    """Encoding of synchronizer -> island updates. int4 trained as well as bf16 over 3 seeds with
    about a quarter of the bytes (benchmarks/RESULTS.md, Bandwidth). A lossy downlink never
    touches the global state, and it does not let an island's copy drift from it: each version is
    sent once as a step from the value the islands hold, carrying what the last step could not
    (error feedback, core/downlink.py), so every island holds the same published value, within
    one quantisation step of the global model. The synchronizer keeps the published value and
    S - 1 encoded steps instead of S - 1 exact past versions (``history``); an island several
    versions behind is sent the steps in between, or the published value whole (fp32) when that
    is fewer bytes."""
    uplink_feedback: bool = True
    """Error feedback on the uplink: an island adds what the codec could not carry of a
    fragment's last push to its next one (one fp32 copy of each fragment on the island's leader;
    core/feedback.py). Needed for int2; with int4 it trained as well as without over 3 seeds
    (+4.4% of DDP's loss against +4.8%: benchmarks/RESULTS.md, int2 and uplink error feedback)."""
    uplink_residual: ResidualHome = "push"
    """Where an island keeps what its uplink could not carry (with ``uplink_feedback``). ``push``:
    added to the fragment's next push. ``parameters``: added to the island's parameters when the
    version its push went into is applied, so the island trains on it and its next push carries it
    in its progress, once; an island reset to the global value instead re-learns what it did not
    send while the held residual keeps it too. For a sparse uplink with its flat tensors sent
    densely (``sparse_dense_tensors``): at cpu-tiny, density 1/16 up, +1.2% of int4's eval loss
    against +2.8% with ``push`` (800 steps, 4 seeds), +5.9% against +7.6% at 3,200 steps (2
    seeds). Not without them: a tensor no push ever sends then stays in each island's parameters,
    and the islands drift apart (+41% at 3,200 steps; benchmarks/RESULTS.md, 2026-11-29). Not with
    ``apply="mix"`` (refused): mix keeps part of the unsent progress, which would count twice."""
    block_size: int = 64
    """Values sharing one scale in int8/int4/int2. Smaller blocks: lower error, more scale bytes."""
    sparse_density: float = 1 / 64
    """The ``sparse`` codec's share of values sent: each chunk of 4096 sends its round(density *
    4096) largest (core/sparse_codec.py), from 1/4096 to 0.5. It needs error feedback: on the
    uplink ``uplink_feedback``, on the downlink always there."""
    sparse_dense_tensors: str = ""
    """Where a direction's codec is ``sparse``: tensors whose fragments go that way in int2
    instead, as comma-separated ``fnmatch`` patterns of parameter names (``lm_head.*``); each must
    match a tensor of the model. A top-k carries badly a tensor whose every value drifts the same
    way round after round: at cpu-tiny the byte-level output head's round of progress has 16% of
    its energy in its top 1/16 (a Gaussian's has 33%) and the uplink's error feedback held a
    backlog of 19 rounds of it; sending that one fragment (an eighth of the model) in int2 took a
    sparse uplink at 1/16 from +4.85% to +2.8% of int4's eval loss (simulated, 4 seeds;
    benchmarks/RESULTS.md, 2026-11-29)."""

    def __post_init__(self) -> None:
        _check_choice("uplink codec", self.uplink, CODECS)
        _check_choice("downlink codec", self.downlink, CODECS)
        # an int (a JSON 64.0 would fail only mid-run, in torch.empty) and bounded: past 2**16 the
        # scales are under 0.02% of an int2 payload already, and every fragment's tail block is
        # padded to a whole block on both sides
        _check(
            isinstance(self.block_size, int) and not isinstance(self.block_size, bool)
            and 8 <= self.block_size <= MAX_BLOCK_SIZE and self.block_size % 4 == 0,
            f"block_size={self.block_size!r} must be a whole multiple of 4 from 8 to {MAX_BLOCK_SIZE} "
            "(int2 packs 4 values a byte)",
        )
        _check(isinstance(self.sparse_density, (int, float)) and not isinstance(self.sparse_density, bool)
               and 1 / 4096 <= self.sparse_density <= 0.5,
               f"sparse_density={self.sparse_density!r} must be a number from 1/4096 (one value of each 4096) to 0.5")
        _check_choice("uplink_residual", self.uplink_residual, RESIDUAL_HOMES)
        _check(not (self.uplink_residual == "parameters" and not self.uplink_feedback),
               "uplink_residual='parameters' needs uplink_feedback=True: without feedback there is no residual to keep "
               "(it would change nothing)")
        _check(not (self.uplink == "sparse" and not self.uplink_feedback),
               "uplink codec 'sparse' needs uplink_feedback=True: without it the values not sent are lost")
        _check(isinstance(self.sparse_dense_tensors, str), f"sparse_dense_tensors={self.sparse_dense_tensors!r} must be "
               "a string of comma-separated name patterns, e.g. 'lm_head.*'")
        if self.sparse_dense_tensors:
            _check("sparse" in (self.uplink, self.downlink), f"sparse_dense_tensors={self.sparse_dense_tensors!r} applies "
                   f"to a sparse codec only, and the codecs are {self.uplink!r} up and {self.downlink!r} down: leave it "
                   "empty or make a direction's codec 'sparse'")
            _check(all(p.strip() for p in self.sparse_dense_tensors.split(",")),
                   f"sparse_dense_tensors={self.sparse_dense_tensors!r} has an empty pattern: separate patterns by "
                   "single commas, e.g. 'lm_head.*,model.embed_tokens.*'")


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """How the islands split the training data (learner side)."""

    seed: int = 0
    """The shuffle seed of every island's distributed sampler: the run's, whatever seed each
    island's process was given. With one permutation, island i of M (rank r of its W processes)
    takes every (M x W)-th index of it from i x W + r, so the islands' shards partition the data as
    DDP's ranks do; islands shuffling with their own seeds would overlap and leave about
    (1 - 1/M)^M of it unseen each epoch."""


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """Everything an island and the synchronizer must agree on."""

    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    codec: CodecConfig = field(default_factory=CodecConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        # mix keeps a share of the island's whole progress, the part its push could not carry
        # included: with that part also added back, it is counted twice each round and grows
        # without bound (cpu-tiny: the residual's norm reached 44,819 and the loss 3.20 against 1.88)
        _check(not (self.codec.uplink_residual == "parameters" and self.schedule.apply == "mix"),
               "uplink_residual='parameters' cannot go with apply='mix', which keeps part of what the push did not "
               "carry and would count it twice: use apply='overwrite' or 'rebase', or uplink_residual='push'")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> RunConfig:
        parts = {"schedule": ScheduleConfig, "merge": MergeConfig, "outer": OuterConfig, "codec": CodecConfig, "data": DataConfig}
        unknown = set(data) - set(parts)
        _check(not unknown, f"unknown config sections {sorted(unknown)}; expected {sorted(parts)}")
        built = {}
        for name, klass in parts.items():
            section = dict(data.get(name, {}))
            known = {f.name for f in dataclasses.fields(klass)}
            extra = set(section) - known
            _check(not extra, f"unknown {name} settings {sorted(extra)}; expected some of {sorted(known)}")
            built[name] = klass(**section)
        return cls(**built)
