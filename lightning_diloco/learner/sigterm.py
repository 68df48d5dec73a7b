"""SIGTERM ends an island's waits at once, and (Fabric) makes a loop without a handler leave the run.

A launcher stops an island with SIGTERM (``lightning-diloco run`` at the end of a run, SLURM,
Kubernetes). A synchronous island (tau = 0) waits for its round inside the step, up to push_wait:
whatever else SIGTERM does, it must first end that wait
(:meth:`~lightning_diloco.learner.island.IslandLearner.stop`), or the island takes a push wait
to stop (the launcher's SIGTERM took 35 s).

- Over a Python handler (Lightning Trainer's, which asks the loop to stop once the batch ends,
  then the strategy's teardown leaves the run; or a Fabric script's own): the waits end, then
  that handler runs.
- Over the default action (``replace_default``: a Fabric script, which has no loop of ours to
  stop): the waits end and ``SystemExit(143)`` (128 + SIGTERM, as a shell reports a SIGTERM) is
  raised in the main thread, so the script unwinds (its ``finally`` blocks run). The island
  leaves the run on the way out, before Python waits for its threads (a push in flight would
  otherwise hold the exit up to push_wait). A second SIGTERM ends the process at once.
- An ignored SIGTERM stays ignored.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

EXIT_ON_SIGTERM = 128 + signal.SIGTERM


class SigtermStop:
    """One island's SIGTERM handler: installed by :meth:`install` (in the main thread, which alone
    receives signals), put back by :meth:`restore`."""

    def __init__(self) -> None:
        self._installed: tuple[Any, Any] | None = None  # (ours, the handler it replaced)

    def install(self, stop: Callable[[], None], *, replace_default: bool = False,
                leave: Callable[[], None] | None = None) -> None:
        """``stop`` ends the island's waits (signal-safe); ``leave`` leaves the run, called on the
        way out when SIGTERM replaced the default action (``replace_default``)."""
        if threading.current_thread() is not threading.main_thread() or self._installed is not None:
            return
        previous = signal.getsignal(signal.SIGTERM)
        if callable(previous):
            def on_sigterm(signum, frame):
                stop()
                previous(signum, frame)
        elif previous == signal.SIG_DFL and replace_default:
            def on_sigterm(signum, frame):
                stop()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
                self._installed = None
                if leave is not None:
                    _before_threads_are_joined(leave)
                raise SystemExit(EXIT_ON_SIGTERM)
        else:
            return
        signal.signal(signal.SIGTERM, on_sigterm)
        self._installed = (on_sigterm, previous)

    def restore(self) -> None:
        if self._installed is None or threading.current_thread() is not threading.main_thread():
            return
        ours, previous = self._installed
        if signal.getsignal(signal.SIGTERM) is ours:  # unless someone installed another since
            signal.signal(signal.SIGTERM, previous)
        self._installed = None


def _before_threads_are_joined(call: Callable[[], None]) -> None:
    """Run ``call`` as the interpreter exits, before it joins its threads (the push pool's
    workers among them); ``atexit`` runs only after that."""
    register = getattr(threading, "_register_atexit", None)  # CPython 3.9+; concurrent.futures uses it
    if register is None:
        import atexit

        atexit.register(call)
        return
    try:
        register(call)
    except RuntimeError:  # the interpreter is already shutting down: leave now
        call()
