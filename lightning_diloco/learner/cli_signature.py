"""The strategy's constructor as LightningCLI sees it: every argument by name, no secret in it.

LightningCLI (jsonargparse) builds ``--trainer.strategy.*`` from the constructor's signature and
docstring. ``**kwargs`` hides what it carries (the run settings not named in the signature, and
DDP's arguments), so those were refused by name; and a token given as an argument is written in
plain text to the ``config.yaml`` the CLI saves. :func:`describe_for_cli` gives the class a
signature that names them and leaves the token out (``token_file`` or ``DILOCO_TOKEN`` instead),
and adds their help to the docstring.
"""

from __future__ import annotations

import inspect
from typing import Optional

from lightning_diloco.core.settings import run_settings

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
