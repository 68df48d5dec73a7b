"""A supervised process tree's states, on a real process."""

from __future__ import annotations

import os
import time

import pytest

from lightning_diloco.launch.supervisor import TRANSITIONS, Supervised, UnitState


def _wait(condition, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_unit_is_paused_resumed_killed_and_waits_for_its_restart():
    unit = Supervised("unit", ["sleep", "60"], lambda: dict(os.environ), echo=lambda line: None)
    try:
        assert unit.state is UnitState.WAITING and not unit.kill() and not unit.pause(until=1.0)  # nothing runs yet
        unit.start()
        assert unit.state is UnitState.RUNNING
        assert unit.pause(until=5.0) and (unit.state, unit.due) == (UnitState.PAUSED, 5.0)
        _wait(lambda: _process_state(unit.proc.pid) == "T", "stopped process")
        unit.resume()
        _wait(lambda: _process_state(unit.proc.pid) != "T", "resumed process")
        assert unit.kill(hold_s=3.0) and unit.state is UnitState.KILLED
        _wait(lambda: unit.poll() is not None, "exit after SIGKILL")
        unit.wait_until(10.0)
        assert (unit.state, unit.due, unit.hold_s) == (UnitState.WAITING, 10.0, 3.0)
        assert not unit.kill() and not unit.pause(until=11.0)  # a fault finds it down: nothing to do
        with pytest.raises(RuntimeError, match="unit: no transition from waiting to finished"):
            unit.finish()
        assert not unit.done
    finally:
        unit.stop()


def test_finished_and_failed_are_final():
    assert TRANSITIONS[UnitState.FINISHED] == TRANSITIONS[UnitState.FAILED] == frozenset()
    assert all(s in TRANSITIONS for s in UnitState)
