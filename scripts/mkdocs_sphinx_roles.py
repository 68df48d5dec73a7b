"""A griffe extension for the API reference (mkdocs.yml): the docstrings' Sphinx roles
(``:class:`~lightning_diloco.core.config.RunConfig```, ``:meth:`start```) become links that
mkdocs checks in strict mode, so a reference to something renamed or removed fails the build.

A role naming an object of this package that the reference shows (public, documented) becomes
an autorefs link; its path is resolved from the docstring's own scope (the object, its class,
its module) when it is not written in full. Anything else (another package's object, a private
one) becomes inline code. A role that names this package's object in full and finds nothing is
kept as a link, so the strict build fails on it.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|exc|obj):`(~?)([\w.]+)`")
PACKAGE = "lightning_diloco"


def _private(path: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in path.split("."))


def _shown(obj) -> bool:
    """Whether the reference renders ``obj`` (what mkdocs.yml's filters keep)."""
    if _private(obj.path) or "_pb2" in obj.path:
        return False
    if obj.is_module or obj.docstring:
        return True
    return any(_shown(m) for m in obj.members.values() if not m.is_alias)


def _target(obj, name: str):
    """The object ``name`` means in ``obj``'s docstring, or None."""
    scopes = [obj, obj.parent, obj.module] if obj.parent is not None else [obj, obj.module]
    if name.startswith(PACKAGE + "."):
        scopes, parts = [obj.package], name.split(".")[1:]
    else:
        parts = name.split(".")
    for scope in scopes:
        found = scope
        try:
            for part in parts:
                found = found.members[part]
                if found.is_alias:
                    found = found.final_target
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        return found
    return None


def _walk(obj):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


def convert(obj) -> None:
    """Rewrite the roles in ``obj``'s docstring as links or inline code."""
    if obj.docstring is None or ":`" not in obj.docstring.value:
        return

    def link(match: re.Match) -> str:
        short, name = match.group(1) == "~", match.group(2)
        text = f"`{name.rsplit('.', 1)[-1] if short else name}`"
        if _private(name):
            return text
        target = _target(obj, name)
        if target is None and name.startswith(PACKAGE + "."):
            return f"[{text}][{name}]"  # written in full and not found: let the strict build fail
        if target is None or not target.path.startswith(PACKAGE + ".") or not _shown(target):
            return text
        return f"[{text}][{target.path}]"

    obj.docstring.value = ROLE.sub(link, obj.docstring.value)


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg, **kwargs) -> None:
        # once the whole package is loaded: a role may name a method defined further down
        for obj in _walk(pkg):
            convert(obj)
