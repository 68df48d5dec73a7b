"""Every reference in the documentation and the code points to something that exists: links,
anchors, the design's module:function table, test files, docs/ pages named in code."""

from __future__ import annotations

import ast
import importlib
import re

import pytest

from tests.docs.markdown import PAGES, ROOT, anchors, links

SOURCES = [p for folder in ("lightning_diloco", "tests", "recipes", "benchmarks", "examples", "scripts")
           for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".sh", ".proto") and p.is_file()]
README_LIMIT = 8_000  # bytes: a page for someone deciding whether to use it; the rest belongs in docs/


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_exists(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}")
    assert broken == [], f"{page.relative_to(ROOT)} links to what does not exist:\n" + "\n".join(broken)


def _resolve(reference: str):
    module_name, _, qualname = reference.partition(":")
    obj = importlib.import_module(f"lightning_diloco.{module_name}")
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


DESIGN_REFERENCE = re.compile(r"`((?:core|transport|synchronizer|learner|launch)(?:\.\w+)+:[\w.]+)`")


def test_every_function_the_design_names_exists():
    """docs/design.md's path of one fragment, threads and locks name module:function; a rename
    in the code must update the design."""
    references = sorted(set(DESIGN_REFERENCE.findall((ROOT / "docs" / "design.md").read_text())))
    assert len(references) > 30, references  # the table was read
    missing = []
    for reference in references:
        try:
            _resolve(reference)
        except (ImportError, AttributeError) as err:
            missing.append(f"{reference}: {err}")
    assert missing == [], "docs/design.md names what the code does not have:\n" + "\n".join(missing)


def test_every_file_a_page_names_exists():
    """Test files, modules and scripts named in backticks (`tests/...py`, `lightning_diloco/...`,
    or a module within the package: `synchronizer/local_link.py`)."""
    missing = []
    for page in PAGES:
        for path in re.findall(r"`((?:tests|lightning_diloco|recipes|benchmarks|examples|scripts)/[\w/.-]*\w)`", page.read_text()):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
        for path in re.findall(r"`((?:core|transport|synchronizer|learner|launch)/[\w/.-]*\w)`", page.read_text()):
            if not (ROOT / "lightning_diloco" / path).exists():  # a module named within the package
                missing.append(f"{page.relative_to(ROOT)}: lightning_diloco/{path}")
    assert missing == [], "\n".join(missing)


def test_code_points_only_to_documents_in_the_repository():
    """No DESIGN.md outside the repository; every docs/ page (and #section) the code names exists,
    and every test file and package module (``core/guard.py``) a source file names."""
    problems = []
    this = ROOT / "tests" / "docs" / "test_references.py"
    for source in SOURCES:
        if source == this:
            continue
        text = source.read_text()
        where = source.relative_to(ROOT)
        if "DESIGN.md" in text:
            problems.append(f"{where}: points to DESIGN.md, which is not in the repository (docs/design.md is)")
        for page, anchor in re.findall(r"\b(docs/[\w/-]+\.md)(?:#([\w-]+))?", text):
            if not (ROOT / page).exists():
                problems.append(f"{where}: {page} does not exist")
            elif anchor and anchor not in anchors(ROOT / page):
                problems.append(f"{where}: {page} has no section #{anchor}")
        for test_file in re.findall(r"\b(tests/[\w/]+\.py)\b", text):
            if not (ROOT / test_file).exists():
                problems.append(f"{where}: {test_file} does not exist")
        for module in re.findall(r"(?<![\w/])(?:lightning_diloco/)?((?:core|transport|synchronizer|learner|launch)/\w+\.(?:py|proto))\b", text):
            if not (ROOT / "lightning_diloco" / module).exists():
                problems.append(f"{where}: lightning_diloco/{module} does not exist")
    assert problems == [], "\n".join(problems)


CROSS_REFERENCE = re.compile(r":(?:func|meth|class|data|attr|exc):`~?([\w.]+)`")


def _names_defined(sources) -> set[str]:
    """Every function, class, assigned name and ``self.`` attribute the sources define."""
    names = set()
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return names


def test_every_name_a_docstring_cross_references_exists():
    """A docstring's :func:`name` (or :class:, :meth:, ...) names something the package defines:
    a rename must take its mentions along (wire.py's docstring named a read_chunk that was gone)."""
    package = [p for p in SOURCES if p.is_relative_to(ROOT / "lightning_diloco") and p.suffix == ".py"]
    defined = _names_defined(package)
    missing = []
    for source in package:
        for reference in CROSS_REFERENCE.findall(source.read_text()):
            if reference.startswith(("lightning.", "torch.")):  # another project's
                continue
            if reference.split(".")[-1] not in defined:
                missing.append(f"{source.relative_to(ROOT)}: {reference}")
    assert missing == [], "docstrings name what the package does not define:\n" + "\n".join(missing)


def test_the_readme_stays_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; keep it under 8 KB and move details into docs/"
