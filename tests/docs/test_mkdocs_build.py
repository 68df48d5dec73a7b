"""The documentation site, API reference included, builds in strict mode: a broken link between
pages, a missing anchor or a docstring reference to a module that no longer exists fails."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.docs.markdown import ROOT


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed; pip install -e '.[dev]' installs it with mkdocstrings")
def test_the_site_builds_in_strict_mode(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    for page in ("index.html", "design/index.html", "api/core/index.html", "api/learner/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    strategy = (tmp_path / "site" / "api" / "learner" / "index.html").read_text()
    assert "lightning_diloco.learner.strategy.DecoupledDiLoCoStrategy" in strategy  # docstrings were rendered
