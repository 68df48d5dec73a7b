"""The recipes' and benchmarks' child processes: bounded, and killed with everything they started.

A benchmark arm is a process that starts others (Lightning's DDP ranks, the launcher's islands and
synchronizer). ``subprocess.run(timeout=...)`` kills only the child it started, so a hung or
interrupted arm left its ranks running (a 2-process arm ignores SIGTERM, the overhead benchmark's
work). Here the child gets a session of its own; on a timeout or an interrupt its process group is
asked to stop (SIGTERM: the launcher then stops its islands, which run in sessions of their own),
then killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence

GRACE_S = 10.0  # seconds between SIGTERM and SIGKILL to the group


def run_tree(cmd: Sequence[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=timeout, **kwargs)`` whose whole process tree is stopped on a
    timeout or an interrupt (the exception is raised again afterwards)."""
    if kwargs.pop("capture_output", False):
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = subprocess.Popen(list(cmd), start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        _stop_group(proc)
        raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def _stop_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=GRACE_S)
    with contextlib.suppress(ProcessLookupError):  # whatever of the group is left, e.g. ranks ignoring SIGTERM
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
