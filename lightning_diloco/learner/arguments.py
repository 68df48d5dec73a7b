"""How the strategy's constructor takes its arguments: from the environment, refused when unknown,
and as LightningCLI sees them (every argument by name, no secret among them).

LightningCLI (jsonargparse) builds ``--trainer.strategy.*`` from the constructor's signature and
docstring. ``**kwargs`` hides what it carries (the run settings not named in the signature, and
DDP's arguments), so those were refused by name; and a token given as an argument is written in
plain text to the ``config.yaml`` the CLI saves. :func:`describe_for_cli` gives the class a
signature that names them and leaves the token out (``token_file`` or ``DILOCO_TOKEN`` instead),
and adds their help to the docstring.
"""

from __future__ import annotations

import difflib
import inspect
import os
from pathlib import Path
from typing import Optional

import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.settings import load_run_config, run_settings


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


def refuse_unknown(names: set[str]) -> None:
    """A misspelt run setting would otherwise reach DDP, which a one-process island never builds:
    it would be ignored without a word."""
    ddp = {name for init in (DDPStrategy.__init__, torch.nn.parallel.DistributedDataParallel.__init__)
           for name, p in inspect.signature(init).parameters.items() if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}
    ddp -= {"self", "module"}
    unknown = sorted(names - ddp)
    if unknown:
        known = [s.name for s in run_settings()] + sorted(ddp)
        hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, n=1)) else repr(name)
                 for name in unknown]
        raise TypeError(f"DecoupledDiLoCoStrategy got unknown arguments {', '.join(hints)}: neither run settings "
                        "(lightning_diloco.core.settings.run_settings()) nor DistributedDataParallel arguments")


def read_token(path: str | os.PathLike | None) -> str | None:
    if path is None:
        return os.environ.get("DILOCO_TOKEN") or None
    try:
        return Path(path).read_text().strip() or None
    except OSError as err:
        raise ValueError(f"token_file={str(path)!r}: {err.strerror or err}") from None


def as_run_config(given: RunConfig | dict | str | os.PathLike | None) -> RunConfig | None:
    if given is None or isinstance(given, RunConfig):
        return given
    if isinstance(given, dict):
        return RunConfig.from_dict(given)
    return load_run_config(given)


# DistributedDataParallel / DDPStrategy arguments a user may set by name; None means not given.
DDP_ARGUMENTS: dict[str, tuple[type, str]] = {
    "find_unused_parameters": (bool, "DDP inside the island: look for parameters that get no gradient (modules "
                                     "with branches unused in a step)."),
    "static_graph": (bool, "DDP inside the island: the autograd graph is the same every step."),
    "gradient_as_bucket_view": (bool, "DDP inside the island: gradients as views into the all-reduce buckets "
                                      "(saves memory)."),
    "broadcast_buffers": (bool, "DDP inside the island: broadcast module buffers from rank 0 every step."),
    "bucket_cap_mb": (float, "DDP inside the island: all-reduce bucket size in MiB."),
    "process_group_backend": (str, "The island's process group backend (gloo, nccl); default: Lightning's choice."),
}
HIDDEN = ("token",)  # a secret: LightningCLI would save it in config.yaml


def describe_for_cli(cls: type) -> None:
    """Give ``cls.__init__`` the signature and Args docs LightningCLI should see."""
    init = cls.__init__
    signature = inspect.signature(init)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD and p.name not in HIDDEN]
    named = {p.name for p in params}
    extra = [(s.name, s.type, s.doc) for s in run_settings() if s.name not in named]
    extra += [(name, kind, doc) for name, (kind, doc) in DDP_ARGUMENTS.items()]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[kind])
               for name, kind, _ in extra]
    init.__signature__ = signature.replace(parameters=params)
    indent = " " * 12
    init.__doc__ = init.__doc__.rstrip() + "\n" + "".join(
        f"{indent}{name}: {doc.replace('``', '')} (run setting)\n" if name not in DDP_ARGUMENTS else f"{indent}{name}: {doc}\n"
        for name, _, doc in extra)


def given_ddp_arguments(kwargs: dict) -> dict:
    """The DDP arguments in ``kwargs`` that were given (None: left to DDP's default)."""
    return {k: v for k, v in kwargs.items() if not (k in DDP_ARGUMENTS and v is None)}
