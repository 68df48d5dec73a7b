"""Police fixtures: a test that leaks threads or child processes fails."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # CI has 2 cores; subprocesses under test get the other one


def _children() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except OSError:
            pass
    return {p for p in pids if Path(f"/proc/{p}").exists() and "Z" not in _state(p)}


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _ours(thread: threading.Thread) -> bool:
    return thread.name.startswith("diloco")


@pytest.fixture(autouse=True)
def no_leaks():
    threads_before = {t.ident for t in threading.enumerate()}
    children_before = _children()
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before and _ours(t) and t.is_alive()]
        leaked_children = _children() - children_before
        if not (leaked_threads or leaked_children) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked_threads, f"test leaked threads: {leaked_threads}"
    assert not leaked_children, f"test leaked child processes: {sorted(leaked_children)}"


@pytest.fixture
def two_torch_threads():
    """torch at 2 threads (a training thread's default on 2 cores) for the test, then back."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)
