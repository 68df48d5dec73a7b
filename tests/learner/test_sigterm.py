"""SIGTERM over a script's own handler ends the island's waits first, then runs that handler; an
ignored SIGTERM stays ignored; restore puts the handler back. (Over the default action, a Fabric
island exits 143 after leaving the run: tests/learner/test_fabric_strategy.py, a real process.)"""

from __future__ import annotations

import os
import signal

import pytest

from lightning_diloco.learner.sigterm import SigtermStop


@pytest.fixture
def sigterm_handler():
    saved = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, saved)


def test_a_scripts_own_handler_runs_after_the_waits_end_and_is_put_back(sigterm_handler):
    calls = []
    own = lambda signum, frame: calls.append("script")  # noqa: E731
    signal.signal(signal.SIGTERM, own)
    stop = SigtermStop()
    stop.install(lambda: calls.append("stop"), replace_default=True, leave=lambda: calls.append("leave"))
    os.kill(os.getpid(), signal.SIGTERM)  # handled in this (main) thread before the next bytecode
    assert calls == ["stop", "script"]  # no exit, no leave: the script's handler decides what happens
    stop.restore()
    assert signal.getsignal(signal.SIGTERM) is own


def test_an_ignored_sigterm_stays_ignored(sigterm_handler):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    SigtermStop().install(lambda: None, replace_default=True)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
