"""Thread hygiene for torch work off the training thread."""

from __future__ import annotations

import torch


def serial_torch_thread() -> None:
    """Make torch ops in the calling (background) thread single-threaded.

    A thread that runs a large torch op gets its own OpenMP team. Once the process holds more
    OpenMP threads than cores, libgomp throttles the spin-wait of every team, the training
    thread's included, so each of the many small ops of a step pays a futex wake-up: measured at
    +25-35% step time on a 2-core machine from a single fragment seeded by a gRPC worker thread.
    ``torch.set_num_threads`` from here sets this thread's OpenMP limit (the training thread
    keeps its own) and the default for threads that have not run torch yet. A synchronizer's
    concurrency comes from its many call threads, which this keeps from oversubscribing cores.
    """
    torch.set_num_threads(1)
