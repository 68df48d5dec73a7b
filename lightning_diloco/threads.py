"""Thread hygiene for torch work off the training thread."""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded, if any (found in this process's memory map)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def serial_torch_thread() -> None:
    """Make torch ops in the calling (background) thread single-threaded; nothing else changes.

    A thread that runs a large torch op gets its own OpenMP team. Once the process holds more
    OpenMP threads than cores, libgomp throttles the spin-wait of every team, the training
    thread's included, so each of the many small ops of a step pays a futex wake-up: measured at
    +33% step time on a 2-core machine. The limit set here is OpenMP's per-thread one, set after
    torch initialized this thread, so the training thread and torch's process-wide setting are
    untouched (``torch.set_num_threads`` from a background thread was measured to slow a
    one-thread training loop 3.5x).
    """
    torch.ones(2).add_(1)  # torch sets this thread's OpenMP limit on its first op: let it go first
    gomp = _libgomp()
    if gomp is not None:
        gomp.omp_set_num_threads(1)
