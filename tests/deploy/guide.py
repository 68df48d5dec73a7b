"""The deployment guide's commands, taken from docs/deployment.md as written (not copies)."""

from __future__ import annotations

from tests.docs.markdown import ROOT, Block, code_blocks

GUIDE = ROOT / "docs" / "deployment.md"


def block(needle: str) -> Block:
    """The one bash block of the guide whose code holds ``needle``."""
    found = [b for b in code_blocks(GUIDE) if b.language == "bash" and needle in b.code]
    assert len(found) == 1, f"docs/deployment.md has {len(found)} bash blocks with {needle!r}, not one"
    return found[0]


def bash(block: Block) -> list[str]:
    """How tests/docs/test_commands.py runs a block."""
    return ["bash", "-euo", "pipefail", "-c", block.code]
