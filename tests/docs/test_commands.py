"""Every command in the README and docs/ runs as written from a clone.

Each page's ```bash and ```python blocks run in order, in a scratch folder that holds links to
the repository's files (so `examples/...` and `recipes` resolve as in a clone, and what the
commands write stays out of the repository) and a `.venv` that is the running interpreter's
environment (so `.venv/bin/...` are the programs of the Python running the tests). A block is marked, on the line before
its fence, with
  <!-- docs-test: skip REASON -->                  not run here (REASON says why: too long, or
                                                    the test suite itself)
  <!-- docs-test: background "TEXT" -->            started in the background; the next blocks run
                                                    once its output shows TEXT, and it is stopped
                                                    with SIGTERM (and must exit 0) when the page ends
  <!-- docs-test: needs PROGRAM -->                 run if PROGRAM (not part of a clone, e.g. openssl)
                                                    is installed; else the rest of the page is not
                                                    run and the test says so as a skip
The documented ports (7470, 7471, 8080, 9090) are replaced with free ones, so two runs of this
test on one machine do not collide. Every block runs in a process group of its own that is killed
when the block ends or times out.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docs.markdown import PAGES, ROOT, Block, code_blocks

RUNNABLE = ("bash", "python")
DOC_PORTS = ("7470", "7471", "8080", "9090")
BLOCK_TIMEOUT = 300.0  # seconds; the longest block (a two-island launcher run) takes about a minute
READY_TIMEOUT = 120.0
NOT_LINKED = {".git", ".venv", "runs", "site", "lightning_logs", "wandb", "build", "dist", ".pytest_cache"}


def _runnable(page: Path) -> list[Block]:
    return [b for b in code_blocks(page) if b.language in RUNNABLE]


def test_every_block_is_run_or_says_why_not():
    """A skipped block names its reason; a background one the output it waits for."""
    problems = []
    for page in PAGES:
        for block in _runnable(page):
            if block.marker == "skip" and len(block.argument) < 10:
                problems.append(f"{block.where}: a skipped block must say why")
            if block.marker == "background" and not re.fullmatch(r'"[^"]+"', block.argument):
                problems.append(f'{block.where}: a background block names the output it waits for in quotes')
            if block.marker == "needs" and not re.fullmatch(r"[\w.-]+", block.argument):
                problems.append(f"{block.where}: a block that needs a program names it")
    assert problems == [], "\n".join(problems)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scratch(tmp_path: Path) -> Path:
    folder = tmp_path / "clone"
    folder.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in NOT_LINKED:
            (folder / entry.name).symlink_to(entry)
    # The commands' `.venv/bin/...` are the running interpreter's environment: the suite may run
    # from another one than the clone's .venv, or from a git worktree, which has no .venv at all
    (folder / ".venv").symlink_to(Path(sys.executable).parent.parent, target_is_directory=True)
    return folder


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    # this checkout's code first, even where .venv holds an editable install of another one
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1", PYTHONUNBUFFERED="1")
    return env


def _command(block: Block, code: str) -> list[str]:
    if block.language == "python":
        return [sys.executable, "-c", code]
    return ["bash", "-euo", "pipefail", "-c", code]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


PAGES_WITH_COMMANDS = [p for p in PAGES if any(b.marker != "skip" for b in _runnable(p))]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", PAGES_WITH_COMMANDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_commands_of_a_page_run_as_written(page, tmp_path):
    cwd, env = _scratch(tmp_path), _environment()
    ports = {port: str(_free_port()) for port in DOC_PORTS}
    background: list[tuple[Block, subprocess.Popen, Path]] = []
    missing = None
    try:
        for n, block in enumerate(_runnable(page)):
            if block.marker == "skip":
                continue
            if block.marker == "needs" and shutil.which(block.argument) is None:
                missing = f"{block.where} and the rest of the page need {block.argument}, which this machine lacks"
                break
            code = block.code
            for documented, free in ports.items():
                code = re.sub(rf"\b{documented}\b", free, code)
            log = tmp_path / f"block-{n}.log"
            with log.open("w") as out:
                proc = subprocess.Popen(_command(block, code), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            if block.marker == "background":
                background.append((block, proc, log))
                ready = block.argument.strip('"')
                deadline = time.monotonic() + READY_TIMEOUT
                while ready not in _tail(log, 10**6):
                    assert proc.poll() is None, f"{block.where} exited with {proc.returncode}:\n{_tail(log)}"
                    assert time.monotonic() < deadline, f"{block.where} never printed {ready!r}:\n{_tail(log)}"
                    time.sleep(0.2)
                continue
            try:
                code_ = proc.wait(timeout=BLOCK_TIMEOUT)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                pytest.fail(f"{block.where} ran past {BLOCK_TIMEOUT:.0f} s:\n{_tail(log)}")
            finally:
                _kill_group(proc)  # whatever the block left running
            assert code_ == 0, f"{block.where} exited with {code_}:\n{code}\n--- output ---\n{_tail(log)}"
    finally:
        stopped = []
        for block, proc, log in background:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                stopped.append((block, proc.wait(timeout=60), log))
            except subprocess.TimeoutExpired:
                stopped.append((block, "still running 60 s after SIGTERM", log))
            _kill_group(proc)
    for block, code_, log in stopped:
        assert code_ == 0, f"{block.where} did not stop cleanly on SIGTERM ({code_}):\n{_tail(log)}"
    if missing:
        pytest.skip(missing)
