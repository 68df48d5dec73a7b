"""The parts of the repository's Markdown the docs tests read: code blocks with their markers,
links, headings and their anchors."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*docs-test:\s*(skip|background|needs)\b(.*?)-->\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    """A fenced code block. ``marker``: ``skip``, ``background`` or ``needs`` from a
    ``<!-- docs-test: ... -->`` comment on the line before it, else ``""`` (run it); ``argument``:
    what follows the marker."""

    page: Path
    line: int
    language: str
    code: str
    marker: str = ""
    argument: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        start = i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        above = lines[start - 1] if start > 0 else ""
        marked = MARKER.match(above.strip())
        marker, argument = (marked.group(1), marked.group(2).strip()) if marked else ("", "")
        blocks.append(Block(page, start + 1, opened.group(1), "\n".join(body) + "\n", marker, argument))
        i += 1
    return blocks


def prose(page: Path) -> str:
    """The page without its code blocks (links and headings inside them are not links)."""
    out, inside = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            out.append(line)
    return "\n".join(out)


def links(page: Path) -> list[str]:
    text = re.sub(r"`[^`]*`", "", prose(page))  # a link inside inline code is not a link
    return [a or b for a, b in LINK.findall(text)]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading (mkdocs gives the same for the headings these pages use;
    its strict build checks the anchors inside docs/)."""
    text = re.sub(r"`", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {github_anchor(m.group(2)) for line in prose(page).splitlines() if (m := HEADING.match(line))}
