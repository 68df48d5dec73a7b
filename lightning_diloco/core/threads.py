"""Keep background torch work from slowing the training loop's own thread team.

Measured with ``benchmarks/overhead.py``: one long-lived thread that ran a single multi-threaded
torch op (seeding a fragment in an embedded synchronizer's gRPC worker) made every later training
step 15-35% slower, and the AdamW step 2.5x slower, for as long as that thread lived. GNU OpenMP
gives each thread that opens a parallel region its own team of worker threads, and while the
process holds more OpenMP threads than CPUs it throttles the spin-wait of idle workers (a
``GOMP_SPINCOUNT`` of 100 instead of 300,000), so each of the thousands of parallel regions in a
training step has to wake its workers from sleep. A thread whose regions run on itself alone adds
no team. ``torch.set_num_threads(1)`` is not the fix: it changes the process-wide default and
resizes shared pools under the training thread.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)

OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")


def single_threaded_torch() -> bool:
    """Run the calling thread's torch ops on that thread alone; other threads keep their teams.

    For threads that live beside a training loop: sync workers, gRPC handlers (pass it as a
    thread pool's ``initializer``). Returns False, changing nothing, where no OpenMP runtime is
    reachable.
    """
    # once torch.set_num_threads(n) has been called anywhere, torch sets each thread's OpenMP
    # team size to n on that thread's first torch call: make that call now, or it would undo
    # the limit set below (checked: it does)
    torch.get_num_threads()
    setter = _omp_set_num_threads()
    if setter is None:
        return False
    setter(1)  # an OpenMP internal control variable of the calling thread only
    return True


@contextmanager
def torch_on_this_thread() -> Iterator[None]:
    """Run the calling thread's torch ops on that thread alone for a moment, then give its team back.

    For the training loop's own short host copies between steps (an island's step boundary): each
    copy of a fragment's tensors opens parallel regions, and where background threads keep a core
    busy each region waits for the team's other worker to be scheduled. Measured with
    ``benchmarks/overhead.py``'s model on 2 shared cores: writing a global fragment into the
    parameters took 0.63-0.65 ms per fragment on one thread against 1.07-1.50 ms on two. The copies
    are memory-bound, so one thread loses little even where the cores are free.
    """
    setter = _omp_set_num_threads()
    threads = torch.get_num_threads()  # this thread's team size
    if setter is None or threads == 1:
        yield
        return
    setter(1)
    try:
        yield
    finally:
        setter(threads)


@functools.cache
def _omp_set_num_threads():
    try:
        return ctypes.CDLL(None).omp_set_num_threads  # torch loads its runtime with global symbols
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if any(name in line for name in OPENMP_LIBRARIES)}
        if paths:
            return ctypes.CDLL(min(paths)).omp_set_num_threads
    except (OSError, AttributeError):
        pass
    log.debug("no OpenMP runtime found: background torch work keeps the default thread count")
    return None
