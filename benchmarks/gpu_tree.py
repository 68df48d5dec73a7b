"""The GPU check's child processes: bounded, their output kept, and every process they start stopped.

A child of the check starts processes in sessions of their own (the launcher's islands and
synchronizer), which stopping the child's process group (``recipes.processes.run_tree``) misses, and
which outlive a check killed from outside and then hold the GPU through a rerun. So every process
of a check carries ``MARK=<the check's pid>`` in its environment (the launcher's clean environment
keeps it): after each child the check kills whatever still carries its own mark, and at its start
whatever carries the mark of a check that is no longer running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from recipes.processes import run_tree

MARK = "LIGHTNING_DILOCO_GPU_CHECK"
TAIL_CHARS = 3000  # of a failed child's output, kept in gpu.json
DEATH_WAIT_S = 30.0  # a SIGKILLed process is gone within moments; this only bounds a stuck one


class ChildFailed(RuntimeError):
    """A child exited non-zero or ran out of its time; the message ends with its last output."""


class Interrupted(KeyboardInterrupt):
    """The check was interrupted (SIGINT, SIGTERM) while a child ran; its tree is stopped."""


def _marked() -> Iterator[tuple[int, str]]:
    """(pid, the mark's value) of every process this user can read that carries the mark."""
    key = MARK.encode() + b"="
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or another user's
            continue
        for item in environ.split(b"\0"):
            if item.startswith(key):
                yield int(entry.name), item[len(key):].decode(errors="replace")
                break


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has stopped: it holds nothing but its exit status)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill(pids: list[int]) -> int:
    """SIGKILL ``pids`` and return once they have stopped: a kill is delivered asynchronously, and a
    rerun started straight after must not find the GPU still held."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + DEATH_WAIT_S
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(pids)


def stop_marked(check: int) -> int:
    """SIGKILL every process carrying check ``check``'s mark; how many there were."""
    return _kill([pid for pid, value in _marked() if value == str(check) and pid != os.getpid()])


def stop_orphans() -> int:
    """SIGKILL what an earlier check left running (its mark names a process that is gone)."""
    return _kill([pid for pid, value in _marked()
                  if pid != os.getpid() and not (value.isdigit() and Path(f"/proc/{value}").exists())])


def output_tail(log: Path) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return text[-TAIL_CHARS:].strip()


def run_child(cmd: Sequence[str], *, what: str, timeout: float, log: Path, cwd: Path, env: dict[str, str]) -> None:
    """Run ``cmd`` marked as this check's, its output (both streams) in ``log``; raise
    :class:`ChildFailed` or :class:`Interrupted` with the end of that output. Whatever of its tree
    is still running afterwards is killed."""
    env = {**env, MARK: str(os.getpid())}
    try:
        with log.open("w") as out:
            done = run_tree(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ChildFailed(f"{what} timed out after {timeout:.0f} s; its last output:\n{output_tail(log)}") from None
    except KeyboardInterrupt:
        raise Interrupted(f"{what} interrupted; its last output:\n{output_tail(log)}") from None
    finally:
        stop_marked(os.getpid())
    if done.returncode != 0:
        raise ChildFailed(f"{what} failed (exit {done.returncode}); its last output:\n{output_tail(log)}")
