"""How the island strategies' constructors take their arguments: from the environment, refused
when unknown, and as LightningCLI sees them (every argument by name, no secret among them).

LightningCLI (jsonargparse) builds ``--trainer.strategy.*`` from the constructor's signature and
docstring. ``**kwargs`` hides what it carries (the run settings not named in the signature, and
the inner strategy's arguments), so those were refused by name; and a token given as an argument
is written in plain text to the ``config.yaml`` the CLI saves. :func:`describe_for_cli` gives a
class a signature that names them and leaves the token out (``token_file`` or ``DILOCO_TOKEN``
instead), and adds their help to the docstring.
"""

from __future__ import annotations

import difflib
import inspect
import os
import warnings
from collections.abc import Callable
from typing import Optional

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.settings import load_run_config, run_settings, value_of


def warn_on_conflicts(asked: set[str], wanted: RunConfig, authoritative: RunConfig, tensors: int) -> None:
    """Warn, naming each, of the settings in ``asked`` whose value in ``wanted`` (the island's)
    the synchronizer's ``authoritative`` one overrides. A fragment count lowered to the model's
    ``tensors`` is no conflict: no setting anywhere could give more."""
    conflicts = []
    for name in sorted(asked):
        value, actual = value_of(wanted, name), value_of(authoritative, name)
        if name == "num_fragments" and actual == tensors < value:
            continue
        if actual != value:
            conflicts.append(f"{name}={value!r} (synchronizer: {actual!r})")
    if conflicts:
        warnings.warn("the synchronizer's run settings are authoritative; ignoring " + ", ".join(conflicts)
                      + ". Set them on the synchronizer instead.", stacklevel=2)


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


def argument_names(*functions: Callable) -> set[str]:
    """The names ``functions`` take as keyword arguments."""
    return {name for f in functions for name, p in inspect.signature(f).parameters.items()
            if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD} - {"self"}


def refuse_unknown(strategy: str, names: set[str], inner: set[str], inner_kind: str) -> None:
    """A misspelt run setting would otherwise reach the inner strategy, which may ignore it (a
    one-process island never builds DDP): it would be ignored without a word."""
    unknown = sorted(names - inner)
    if unknown:
        known = [s.name for s in run_settings()] + sorted(inner)
        hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, n=1)) else repr(name)
                 for name in unknown]
        raise TypeError(f"{strategy} got unknown arguments {', '.join(hints)}: neither run settings "
                        f"(lightning_diloco.core.settings.run_settings()) nor {inner_kind} arguments")


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


def describe_for_cli(cls: type, inner: dict[str, tuple[type, str]], island_init: Callable) -> None:
    """Give ``cls.__init__`` the signature and Args docs LightningCLI should see: its own
    arguments, the island's (``island_init``'s) and every run setting it does not name, and the
    ``inner`` strategy's arguments (name -> (type, help)) that ``**kwargs`` would carry."""
    init = cls.__dict__.get("__init__")
    if init is None:  # it takes the island's arguments as they are: a constructor of its own to describe

        def init(self, *args, **kwargs):
            super(cls, self).__init__(*args, **kwargs)

        init.__signature__, init.__doc__ = inspect.signature(island_init), island_init.__doc__  # type: ignore[attr-defined]  # read by inspect.signature
        init.__qualname__ = f"{cls.__qualname__}.__init__"
        cls.__init__ = init  # type: ignore[misc]  # deliberate: the class gets a described constructor
    signature = inspect.signature(init)
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD and p.name not in HIDDEN]
    named = {p.name for p in params}
    island = [p for p in inspect.signature(island_init).parameters.values()
              if p.kind is p.KEYWORD_ONLY and p.name not in named and p.name not in HIDDEN]
    params += island
    named |= {p.name for p in island}
    extra = [(s.name, s.type, s.doc) for s in run_settings() if s.name not in named]
    extra += [(name, kind, doc) for name, (kind, doc) in inner.items() if name not in named]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[kind])  # noqa: UP045 - built at run time from kind, which may be a string or typing form
               for name, kind, _ in extra]
    init.__signature__ = signature.replace(parameters=params)
    indent = " " * 12
    init.__doc__ = init.__doc__.rstrip() + "\n" + "".join(
        f"{indent}{name}: {doc.replace('``', '')} (run setting)\n" if name not in inner else f"{indent}{name}: {doc}\n"
        for name, _, doc in extra)


def given_arguments(kwargs: dict, inner: dict[str, tuple[type, str]]) -> dict:
    """``kwargs`` without the ``inner`` arguments left at None (:func:`describe_for_cli`'s
    default: the inner strategy's own default applies)."""
    return {k: v for k, v in kwargs.items() if not (k in inner and v is None)}
