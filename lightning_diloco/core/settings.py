"""The run settings as one flat table, read off the dataclasses in ``core/config.py``.

The dataclasses are the only place a setting is written down: its section, type, default,
choices (a ``Literal``) and documentation (the attribute's docstring). Everything that offers
the settings to a user is generated from this table: the synchronizer's flags, the strategy's
keyword arguments, the recipes' options. Adding a setting is one edit to ``core/config.py``.

A setting's public name is its field name, except where that would be ambiguous across
sections (``PUBLIC_NAMES``): ``merge`` for ``merge.method``, ``outer_lr`` for ``outer.lr``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import os
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_diloco.core.config import RunConfig

PUBLIC_NAMES = {
    ("merge", "method"): "merge",
    ("outer", "lr"): "outer_lr",
    ("outer", "momentum"): "outer_momentum",
    ("codec", "uplink"): "uplink_codec",
    ("codec", "downlink"): "downlink_codec",
    ("data", "seed"): "data_seed",
}


@dataclass(frozen=True)
class Setting:
    name: str
    """Public name: the strategy's keyword argument, the flag ``--name-with-dashes``."""
    section: str
    field: str
    type: type
    default: Any
    choices: tuple[Any, ...] | None
    doc: str
    """The field's docstring, whitespace folded."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def help(self) -> str:
        """The doc as command-line help: no reST quotes, and argparse's % escaped."""
        return self.doc.replace("``", "").replace("%", "%%")


def _attribute_docs(klass: type) -> dict[str, str]:
    """``{field: docstring}`` of the string literals that follow a class's annotated fields
    (empty where the source is not shipped: the settings then work, without help text)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@functools.cache
def run_settings() -> tuple[Setting, ...]:
    """Every run setting, in the order of ``RunConfig``'s sections and their fields."""
    table = []
    for section in dataclasses.fields(RunConfig):
        klass = typing.get_type_hints(RunConfig)[section.name]
        hints, docs, defaults = typing.get_type_hints(klass), _attribute_docs(klass), klass()
        for f in dataclasses.fields(klass):
            hint = hints[f.name]
            choices = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else None
            table.append(Setting(
                name=PUBLIC_NAMES.get((section.name, f.name), f.name), section=section.name, field=f.name,
                type=type(choices[0]) if choices else hint, default=getattr(defaults, f.name), choices=choices,
                doc=docs.get(f.name, ""),
            ))
    names = [s.name for s in table]
    assert len(set(names)) == len(names), f"two run settings share a public name: {names}; extend PUBLIC_NAMES"
    return tuple(table)


def setting(name: str) -> Setting:
    by_name = {s.name: s for s in run_settings()}
    if name not in by_name:
        raise ValueError(f"unknown run setting {name!r}; the run settings are {', '.join(sorted(by_name))}")
    return by_name[name]


def value_of(config: RunConfig, name: str) -> Any:
    s = setting(name)
    return getattr(getattr(config, s.section), s.field)


def config_with(settings: dict[str, Any], base: RunConfig | None = None) -> RunConfig:
    """``base`` (default: the library's defaults) with the named settings replaced, validated.

    ``sync_every`` given without ``num_fragments`` also lowers P to at most H, so that H alone
    is a valid request (P = H sends one fragment per step).
    """
    base = base or RunConfig()
    sections: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(RunConfig)}
    for name, value in settings.items():
        s = setting(name)
        sections[s.section][s.field] = value
    schedule = sections["schedule"]
    if "sync_every" in schedule and "num_fragments" not in schedule:
        schedule["num_fragments"] = min(base.schedule.num_fragments, schedule["sync_every"])
    return dataclasses.replace(base, **{
        name: dataclasses.replace(getattr(base, name), **changes) for name, changes in sections.items() if changes
    })


def changed_settings(config: RunConfig, base: RunConfig | None = None) -> dict[str, Any]:
    """The settings whose value in ``config`` differs from ``base`` (default: the library's):
    ``config_with(changed_settings(c)) == c``."""
    base = base or RunConfig()
    return {s.name: value_of(config, s.name) for s in run_settings() if value_of(config, s.name) != value_of(base, s.name)}


def load_run_config(path: str | os.PathLike) -> RunConfig:
    """A run config from JSON: ``{"merge": {"min_quorum": 2}, ...}``; sections and fields left
    out keep their defaults (the format ``RunConfig.to_dict`` writes)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"run config {path}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"run config {path} is not JSON: {err}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"run config {path} must be an object of sections, e.g. {{\"merge\": {{\"min_quorum\": 2}}}}")
    try:
        return RunConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"run config {path}: {err}") from None


# ---- command lines ------------------------------------------------------------------------------


def add_setting_arguments(group: argparse._ActionsContainer, *, show_defaults: bool = True) -> None:
    """One option per run setting. Each defaults to None, so ``given_settings`` can tell what
    the user set from what they left to a config file, a preset or the library."""
    for s in run_settings():
        help = s.help + (f" (default {s.default})" if show_defaults else "")
        if s.type is bool:
            group.add_argument(s.flag, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            metavar = None if s.choices else s.type.__name__.upper()
            group.add_argument(s.flag, type=s.type, choices=s.choices, default=None, metavar=metavar, help=help)


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run settings set on a command line built by ``add_setting_arguments``."""
    return {s.name: getattr(args, s.name) for s in run_settings() if getattr(args, s.name, None) is not None}


def setting_flags(settings: dict[str, Any]) -> list[str]:
    """``{"min_quorum": 2, "nesterov": False}`` -> ``["--min-quorum=2", "--no-nesterov"]``, as
    ``add_setting_arguments`` reads them."""
    flags = []
    for name, value in settings.items():
        s = setting(name)
        if s.type is bool:
            flags.append(s.flag if value else "--no-" + s.flag[2:])
        else:
            flags.append(f"{s.flag}={value}")
    return flags
