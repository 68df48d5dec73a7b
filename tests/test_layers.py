"""The package's layers point one way (docs/design.md, "Layers"), read from the source.

``core`` <- ``transport`` <- ``synchronizer`` <- ``learner`` (which embeds a synchronizer in
process) <- ``launch`` <- ``cli``, and ``simulate`` (the synchronizer's service and the island's
learner on a virtual clock) beside ``launch``; ``reasons`` is beside ``core``. Every import statement counts,
those inside functions and under ``TYPE_CHECKING`` too: a lazy import is still a dependency, and
one that breaks the rule would load Lightning or gRPC where the import-time test in
test_packaging.py does not look.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_diloco"

# What each layer may import from the package, itself included.
MAY_IMPORT = {
    "core": {"core"},
    "reasons": set(),
    "transport": {"core", "reasons", "transport"},
    "synchronizer": {"core", "reasons", "transport", "synchronizer"},
    "learner": {"core", "reasons", "transport", "synchronizer", "learner"},
    "launch": {"core", "reasons", "transport", "synchronizer", "learner", "launch"},
    "simulate": {"core", "reasons", "transport", "synchronizer", "learner", "simulate"},
    "cli": {"core", "reasons", "transport", "synchronizer", "learner", "launch", "cli", "__init__"},  # __version__
    "__init__": {"_registration"},  # its public names load their modules lazily, on first use
    "_registration": set(),
}
# The repository's folders built on the package: it imports none of them.
ABOVE_THE_PACKAGE = ("recipes", "benchmarks", "examples", "tests")
# Third-party packages a layer must not reach, directly or through the package's modules it imports.
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric")
GRPC = ("grpc", "google.protobuf")
MUST_NOT_REACH = {"core": LIGHTNING + GRPC, "reasons": LIGHTNING + GRPC, "transport": LIGHTNING,
                  "synchronizer": LIGHTNING}


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    """``lightning_diloco.x.y`` -> its file, for every module of the package."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if path.name == "__init__.py" else parts)] = path
    return names


def imported(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """Every module the file imports, with its line: ``from a.b import c`` is ``a.b.c`` when that
    is a module of the package, else ``a.b``."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package, one level up per dot past the first
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.append((f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base, node.lineno))
    return found


def layer(name: str) -> str:
    """``lightning_diloco.core.codecs`` -> ``core``; the package itself -> ``__init__``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def reaches(name: str, forbidden: tuple[str, ...], modules: dict[str, Path], graph: dict[str, list[tuple[str, int]]]) -> str | None:
    """The import chain from ``name`` to a ``forbidden`` package, if there is one."""
    seen, stack = {name}, [(name, name)]
    while stack:
        current, chain = stack.pop()
        for target, line in graph[current]:
            if any(target == f or target.startswith(f + ".") for f in forbidden):
                return f"{chain} (line {line}) -> {target}"
            if target in modules and target not in seen:
                seen.add(target)
                stack.append((target, f"{chain} (line {line}) -> {target}"))
    return None


def layer_violations(package: Path = PACKAGE) -> list[str]:
    """Each import that breaks a rule above, said with its file and line (empty: none)."""
    modules = module_names(package)
    graph = {name: imported(path, name, modules) for name, path in modules.items()}
    problems = []
    for name, imports in sorted(graph.items()):
        mine = layer(name)
        allowed = MAY_IMPORT.get(mine)
        if allowed is None:
            problems.append(f"{name}: layer {mine!r} is not in MAY_IMPORT; say in test_layers.py what it may import")
            continue
        for target, line in imports:
            if target.split(".")[0] in ABOVE_THE_PACKAGE:
                problems.append(f"{modules[name].relative_to(package.parent)}:{line}: {name} imports {target}, "
                                "which is outside the package and built on it")
            if target.split(".")[0] == "lightning_diloco" and layer(target) not in allowed:
                problems.append(f"{modules[name].relative_to(package.parent)}:{line}: {name} ({mine}) imports "
                                f"{target} ({layer(target)}), which {mine} may not")
        forbidden = MUST_NOT_REACH.get(mine)
        chain = reaches(name, forbidden, modules, graph) if forbidden else None
        if chain:
            problems.append(f"{mine} must import none of {', '.join(forbidden)}: {chain}")
    return problems


def test_every_import_of_the_package_points_down_its_layers():
    problems = layer_violations()
    assert not problems, "imports against docs/design.md's layers:\n" + "\n".join(problems)


def test_every_module_of_the_package_was_read():
    """The walk finds the package's layers: a rename of the folder would make the rules vacuous."""
    layers = {layer(name) for name in module_names()}
    assert {"core", "transport", "synchronizer", "learner", "launch", "simulate", "cli", "reasons"} <= layers


@pytest.mark.parametrize("source, expected", [
    ("import lightning.pytorch as pl\n", "core must import none of lightning"),
    ("from lightning_diloco.transport import wire\n", "imports lightning_diloco.transport.wire (transport), which core may not"),
    ("def later():\n    from lightning_diloco.learner import island\n", "imports lightning_diloco.learner.island (learner)"),
    ("from recipes.common import Recipe\n", "imports recipes.common, which is outside the package"),
    ("from lightning_diloco.core import lazy\n",
     "lightning_diloco.core.bad (line 1) -> lightning_diloco.core.lazy (line 3) -> lightning_diloco.core.deep (line 2) -> grpc"),
])
def test_a_core_module_that_breaks_the_rules_is_named(tmp_path, source, expected):
    """A tiny package of the same name: the check names the file, the line, and the chain of
    imports (a lazy one too) by which core reaches gRPC."""
    root = tmp_path / "lightning_diloco"
    for folder in ("core", "transport", "learner"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "transport" / "wire.py").write_text("import grpc\n")
    (root / "learner" / "island.py").write_text("")
    (root / "core" / "lazy.py").write_text("\ndef load():\n    from lightning_diloco.core import deep\n")
    (root / "core" / "deep.py").write_text("\nimport grpc\n")
    (root / "core" / "bad.py").write_text(source)
    problems = "\n".join(layer_violations(root))
    assert expected in problems
