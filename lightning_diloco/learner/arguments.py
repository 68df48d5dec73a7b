"""An island strategy's arguments: :class:`IslandSettings`, declared once, and how the four
strategies take them (from the environment, refused when unknown, and as LightningCLI sees them).

A strategy's constructor is ``__init__(self, **kwargs: <Strategy>Arguments)``: the island's
arguments, every run setting by name (``lightning_diloco.core.settings.run_settings()``) and its
inner strategy's. The ``Arguments`` type is a ``TypedDict`` built here from those three tables,
so LightningCLI (jsonargparse reads ``**kwargs: Unpack[TypedDict]``) offers each by name with its
help, and none is declared twice; the token is not among them (LightningCLI would write it to
``config.yaml``): ``token_file`` or ``DILOCO_TOKEN`` instead, or ``token=`` in Python.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, TypedDict, Unpack

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.settings import config_with, load_run_config, run_settings, value_of
from lightning_diloco.core.token_options import read_token
from lightning_diloco.learner.tokens import default_tokens_per_batch

PROGRESS_LINES_ENV = "DILOCO_PROGRESS_LINES"
"""Seconds between an island's progress lines when its output is not a terminal
(learner/line_progress.py); the launcher sets it for every island it starts."""


@dataclass(kw_only=True)
class IslandSettings:
    """Where an island stands in a Decoupled DiLoCo run, and its run settings.

    Arguments left as None come from the environment (``DILOCO_*``) or from the run defaults of
    :class:`~lightning_diloco.core.config.RunConfig`. A remote synchronizer's run settings are
    authoritative: the island's then only warn where they differ.

    Args:
        synchronizer: The synchronizer's address, ``host:port``, comma-separated for shards
            (``DILOCO_SYNCHRONIZER``). None starts an embedded synchronizer in this process,
            called directly, for a one-island run (refused when num_islands > 1).
        island: This island's index i in [0, num_islands) (``DILOCO_ISLAND``, default 0); it
            trains on shard i of the data.
        num_islands: M, the islands in the run (``DILOCO_NUM_ISLANDS``, default 1).
        token: The run's shared secret (or this island's credential) if the synchronizer
            requires one (``DILOCO_TOKEN``). Not an argument of LightningCLI, which would save
            it in config.yaml.
        token_file: A file holding the token, for LightningCLI's config.yaml and for anything
            else that should not hold the secret itself.
        run_config: Every run setting at once: a ``RunConfig``, its ``to_dict()`` form, or the
            path of such a JSON file (the synchronizer's ``--config``). Run settings given by
            name override it.
        tokens_per_batch: Counts a batch's tokens for the merge weights (default:
            attention-mask ones, else ``input_ids`` elements, else samples).
        end_with_global_model: Load the global model when training ends (Fabric:
            ``teardown()``), if it holds some of this island's work (otherwise the local weights
            stay, with a warning).
        push_wait: Seconds a sent fragment may wait for its round before the send counts as
            failed.
        join_wait: Seconds an island waits at start for a synchronizer it cannot reach yet
            (started later, or restarting) before failing.
        settings: Run settings by name (``sync_every=8``, ``history=6``; see
            ``lightning_diloco.core.settings.run_settings()``).
    """

    synchronizer: str | None = None
    island: int | None = None
    num_islands: int | None = None
    token: str | None = None
    token_file: str | os.PathLike | None = None
    run_config: RunConfig | dict | str | os.PathLike | None = None
    tokens_per_batch: Callable[[Any], float] | None = None
    end_with_global_model: bool = True
    push_wait: float = 120.0
    join_wait: float = 300.0
    settings: dict[str, Any] = field(default_factory=dict)
    # resolved from the above when built
    config: RunConfig = field(init=False)
    """The run settings: ``run_config`` with the ones given by name over it (validated now, not
    when training starts)."""
    base_config: RunConfig | None = field(init=False)
    explicit: dict[str, Any] = field(init=False)
    """The run settings given by name."""

    def __post_init__(self) -> None:
        self.synchronizer = self.synchronizer or os.environ.get("DILOCO_SYNCHRONIZER") or None
        counted = self.num_islands is not None or bool(os.environ.get("DILOCO_NUM_ISLANDS"))
        self.island = env_int("DILOCO_ISLAND", self.island, 0)
        self.num_islands = env_int("DILOCO_NUM_ISLANDS", self.num_islands, 1)
        if not 0 <= self.island < self.num_islands:
            unset = ("" if counted else " (neither num_islands= nor DILOCO_NUM_ISLANDS was given: every island of a "
                     "run needs the run's island count)")
            raise ValueError(f"island={self.island} must be in [0, num_islands={self.num_islands}){unset}; "
                             "set DILOCO_ISLAND (island=) below DILOCO_NUM_ISLANDS (num_islands=)")
        if self.num_islands > 1 and self.synchronizer is None:
            # an embedded synchronizer serves this process only: the island would train alone, on
            # 1/M of the data, and no other island could ever reach it
            raise ValueError(
                f"island {self.island} of num_islands={self.num_islands} has no synchronizer to share its work with: "
                "set DILOCO_SYNCHRONIZER=host:port (or synchronizer=...) to one started with `lightning-diloco "
                "synchronizer`, let `lightning-diloco run --islands M -- COMMAND` start every island and the "
                "synchronizer, or train one island alone with num_islands=1 (DILOCO_NUM_ISLANDS unset)")
        self.token = self.token if self.token is not None else read_token(self.token_file, "token_file")
        self.explicit = {k: v for k, v in self.settings.items() if v is not None}
        self.base_config = as_run_config(self.run_config)
        self.config = config_with(self.explicit, self.base_config)

    def place(self) -> tuple[int, int]:
        """(island, num_islands): the arguments or DILOCO_ISLAND / DILOCO_NUM_ISLANDS."""
        assert self.island is not None and self.num_islands is not None, "__post_init__ resolves both, or refuses"
        return self.island, self.num_islands

    def count_tokens(self, batch: Any) -> float:
        """``batch``'s tokens for the merge weights: ``tokens_per_batch``, or by default the token ids'."""
        return (self.tokens_per_batch or default_tokens_per_batch)(batch)

    @classmethod
    def split(cls, strategy: str, kwargs: dict[str, Any], inner: set[str], inner_kind: str
              ) -> tuple[IslandSettings, dict[str, Any]]:
        """``kwargs`` as the island's settings and the rest, for the ``inner`` strategy; a name
        that is neither is refused, with the name it most likely meant."""
        own, named = ISLAND_ARGUMENTS, {s.name for s in run_settings()}
        unknown = sorted(set(kwargs) - own - named - inner)
        if unknown:
            known = sorted(own | named | inner)
            hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, n=1))
                     else repr(name) for name in unknown]
            # a misspelt run setting would otherwise reach the inner strategy, which may ignore it
            # (a one-process island never builds DDP): it would be ignored without a word
            raise TypeError(f"{strategy} got unknown arguments {', '.join(hints)}: neither run settings "
                            f"(lightning_diloco.core.settings.run_settings()) nor {inner_kind} arguments")
        settings = cls(**{k: v for k, v in kwargs.items() if k in own},
                       settings={k: v for k, v in kwargs.items() if k in named})
        # an inner argument left at None (LightningCLI's default) takes the inner strategy's own default
        return settings, {k: v for k, v in kwargs.items() if k in inner and not (k in DDP_ARGUMENTS and v is None)}

    def warn_on_conflicts(self, authoritative: RunConfig, tensors: int) -> None:
        """Warn, naming each, of the settings the user asked for (by name, or all of a
        ``run_config``) that the synchronizer's ``authoritative`` ones override. A fragment count
        lowered to the model's ``tensors`` is no conflict: no setting anywhere could give more."""
        asked = {s.name for s in run_settings()} if self.base_config is not None else set(self.explicit)
        conflicts = []
        for name in sorted(asked):
            value, actual = value_of(self.config, name), value_of(authoritative, name)
            if name == "num_fragments" and actual == tensors < value:
                continue
            if actual != value:
                conflicts.append(f"{name}={value!r} (synchronizer: {actual!r})")
        if conflicts:
            warnings.warn("the synchronizer's run settings are authoritative; ignoring " + ", ".join(conflicts)
                          + ". Set them on the synchronizer instead.", stacklevel=3)


ISLAND_ARGUMENTS = {f.name for f in dataclasses.fields(IslandSettings) if f.init} - {"settings"}
HIDDEN = {"token", "settings"}  # not offered to LightningCLI: the token would be saved in config.yaml


def env_int(name: str, value: int | None, default: int) -> int:
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def as_run_config(given: RunConfig | dict | str | os.PathLike | None) -> RunConfig | None:
    if given is None or isinstance(given, RunConfig):
        return given
    if isinstance(given, dict):
        return RunConfig.from_dict(given)
    return load_run_config(given)


def argument_names(*functions: Callable) -> set[str]:
    """The names ``functions`` take as keyword arguments."""
    return {name for f in functions for name, p in inspect.signature(f).parameters.items()
            if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD} - {"self"}


# DistributedDataParallel / DDPStrategy arguments a user may set by name; None means not given.
DDP_ARGUMENTS: dict[str, tuple[Any, str]] = {
    "find_unused_parameters": (bool, "DDP inside the island: look for parameters that get no gradient (modules "
                                     "with branches unused in a step)."),
    "static_graph": (bool, "DDP inside the island: the autograd graph is the same every step."),
    "gradient_as_bucket_view": (bool, "DDP inside the island: gradients as views into the all-reduce buckets "
                                      "(saves memory)."),
    "broadcast_buffers": (bool, "DDP inside the island: broadcast module buffers from rank 0 every step."),
    "bucket_cap_mb": (float, "DDP inside the island: all-reduce bucket size in MiB."),
    "process_group_backend": (str, "The island's process group backend (gloo, nccl); default: Lightning's choice."),
}
# ModelParallelStrategy arguments (the Trainer's and Fabric's) a user may set by name.
FSDP_ARGUMENTS: dict[str, tuple[Any, str]] = {
    "data_parallel_size": (Any, "Ranks the model is sharded over; \"auto\" (default): all of the island's "
                                "(unlike ModelParallelStrategy's default, the number of nodes)."),
    "tensor_parallel_size": (int, "Must be 1 (default) for now: tensor parallelism inside an island is not "
                                  "supported yet (its ranks would count the same tokens twice)."),
    "save_distributed_checkpoint": (bool, "As for ModelParallelStrategy: each rank saves its shard (default True)."),
    "process_group_backend": (str, "As for ModelParallelStrategy (default: gloo on CPU, nccl on GPU)."),
    "timeout": (Any, "As for ModelParallelStrategy: the process group's timeout (a datetime.timedelta)."),
}


def strategy_arguments(name: str, inner: dict[str, tuple[Any, str]]) -> Any:
    """``Unpack`` of a ``TypedDict`` of every argument a strategy takes by name (the island's, the
    run settings, the ``inner`` strategy's: name -> (type, help)), each documented, for
    ``**kwargs``: what LightningCLI offers. Built from the tables, so mypy sees none of its keys."""
    keys: dict[str, tuple[Any, str]] = {f.name: (f.type, "") for f in dataclasses.fields(IslandSettings)
                                        if f.init and f.name not in HIDDEN}
    keys.update({s.name: (s.type, s.doc.replace("``", "") + " (run setting)") for s in run_settings()})
    keys.update(inner)
    typed = TypedDict(name, {k: Optional[t] for k, (t, _) in keys.items()}, total=False)  # type: ignore[misc]  # noqa: UP045 - built at run time from the tables
    # IslandSettings' Args section (the last of its docstring), continued with the others' help
    typed.__doc__ = inspect.cleandoc(IslandSettings.__doc__ or "") + "\n" + "".join(
        f"    {k}: {' '.join(doc.split())}\n" for k, (_, doc) in keys.items() if doc)
    return Unpack[typed]


DDPIslandArguments = strategy_arguments("DDPIslandArguments", DDP_ARGUMENTS)
FSDPIslandArguments = strategy_arguments("FSDPIslandArguments", FSDP_ARGUMENTS)
FabricFSDPIslandArguments = strategy_arguments("FabricFSDPIslandArguments", {
    "parallelize_fn": (Callable[[Any, Any], Any], "(module, device_mesh) -> module, as for Fabric's "
                       "ModelParallelStrategy: shards the module (default: fabric_fsdp_strategy.shard_whole_model)."),
    **FSDP_ARGUMENTS,
})
