"""One supervised process tree: clean environment, prefixed output, signals, restarts."""

from __future__ import annotations

import enum
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# Variables of an enclosing launcher that would make an island join someone else's world.
INHERITED_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "OMPI_", "PMIX_", "DILOCO_")
INHERITED_NAMES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                   "LOCAL_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS")


def clean_environment(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in INHERITED_NAMES and not k.startswith(INHERITED_PREFIXES)}
    env.update(extra)
    return env


MTIME_SLACK_S = 0.05


class UnitState(enum.Enum):
    """Where a supervised process tree is in its life. Every change goes through
    :meth:`Supervised._move`, which refuses one that :data:`TRANSITIONS` does not list."""

    WAITING = "waiting"
    """Not running; (re)started at ``due`` once one is set: a staggered start, a backoff after a
    crash, a chaos hold."""
    RUNNING = "running"
    PAUSED = "paused"
    """Stopped (SIGSTOP) by a chaos fault until ``due``."""
    KILLED = "killed"
    """Killed on purpose by a chaos fault: its exit is expected and it restarts ``hold_s`` later."""
    FINISHED = "finished"
    """Exited 0 on its own: its work is done."""
    FAILED = "failed"
    """Refused for good, or out of restarts: not started again."""


TRANSITIONS: dict[UnitState, frozenset[UnitState]] = {
    UnitState.WAITING: frozenset({UnitState.WAITING, UnitState.RUNNING}),  # a new unit is waiting, with no time set
    UnitState.RUNNING: frozenset({UnitState.PAUSED, UnitState.KILLED, UnitState.WAITING, UnitState.FINISHED, UnitState.FAILED}),
    UnitState.PAUSED: frozenset({UnitState.RUNNING, UnitState.KILLED, UnitState.WAITING, UnitState.FINISHED, UnitState.FAILED}),
    UnitState.KILLED: frozenset({UnitState.WAITING, UnitState.FAILED}),
    UnitState.FINISHED: frozenset(),
    UnitState.FAILED: frozenset(),
}


class Supervised:
    """A process started in its own session so its whole tree can be signalled at once."""

    def __init__(self, name: str, command: Sequence[str], make_env: Callable[[], dict[str, str]],
                 echo: Callable[[str], None] | None = None) -> None:
        """``echo``: where its output lines go (default: stdout, prefixed with its name)."""
        self.name, self.command, self.make_env = name, list(command), make_env
        self.echo = echo or (lambda line: sys.stdout.write(f"[{name}] {line}"))
        self.proc: subprocess.Popen | None = None
        self.lifetimes: list[tuple[float, float | None]] = []  # (start, end or None) per incarnation
        self.restarts = 0
        self.started_wall = 0.0  # time.time() at the latest start
        self.state = UnitState.WAITING
        self.due: float | None = None  # WAITING: when to start it; PAUSED: when to resume it
        self.hold_s = 0.0  # KILLED: how long it stays down after its exit
        self._reader: threading.Thread | None = None
        self.last_lines: deque[str] = deque(maxlen=20)  # its latest output, to say why it failed
        self.early_failure: str | None = None  # how its latest incarnation failed before its first step, if it did

    @property
    def done(self) -> bool:
        return self.state in (UnitState.FINISHED, UnitState.FAILED)

    def _move(self, state: UnitState, due: float | None = None) -> None:
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"{self.name}: no transition from {self.state.value} to {state.value}")
        self.state, self.due = state, due

    def wait_until(self, due: float) -> None:
        """Start (or restart) it at ``due``."""
        self._move(UnitState.WAITING, due)

    def pause(self, until: float) -> bool:
        """SIGSTOP its tree until ``until``; False when it is not running (nothing to pause)."""
        if self.state is not UnitState.RUNNING or not self.alive:
            return False
        self.signal(signal.SIGSTOP)
        self._move(UnitState.PAUSED, until)
        return True

    def resume(self) -> None:
        self.signal(signal.SIGCONT)
        self._move(UnitState.RUNNING)

    def kill(self, hold_s: float = 0.0) -> bool:
        """SIGKILL its tree on purpose; it restarts ``hold_s`` after the exit. False when it is not
        running (a fault cannot kill what is already down)."""
        if self.state not in (UnitState.RUNNING, UnitState.PAUSED) or not self.alive:
            return False
        self._move(UnitState.KILLED)
        self.hold_s = hold_s
        self.signal(signal.SIGKILL)
        return True

    def finish(self) -> None:
        self._move(UnitState.FINISHED)

    def fail(self) -> None:
        self._move(UnitState.FAILED)

    def start(self) -> None:
        self._move(UnitState.RUNNING)
        self.last_lines.clear()  # this process's output only: the last one's failure is not its own
        self.proc = subprocess.Popen(self.command, env=self.make_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True)
        self.lifetimes.append((time.monotonic(), None))
        self.started_wall = time.time()  # beside a progress file's mtime: has this incarnation stepped yet
        self._reader = threading.Thread(target=self._pump, args=(self.proc,), name=f"diloco-launch-{self.name}", daemon=True)
        self._reader.start()

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None  # start() opens it with stdout=PIPE
        for line in proc.stdout:
            self.last_lines.append(line.rstrip())
            self.echo(line)
        proc.stdout.close()

    def _running(self) -> subprocess.Popen | None:
        """Its current process while that runs, else None."""
        return self.proc if self.proc is not None and self.proc.poll() is None else None

    @property
    def alive(self) -> bool:
        return self._running() is not None

    def activity(self, progress: Path) -> str:
        """What the progress line says of it: ``training`` once its current process wrote
        ``progress``, ``starting`` before, ``down`` between a death and its restart, ``finished``
        or ``failed`` at the end. (A restarted process counted as running while it imported and
        joined: the line said 4/4 during an outage.)"""
        if self.done:
            return self.state.value
        if self.state is UnitState.PAUSED:
            return "paused"
        if not self.alive:
            return "down"
        return "training" if self.stepped(progress) else "starting"

    def stepped(self, progress: Path) -> bool:
        """Whether its current (or latest) process wrote ``progress``: made a training step."""
        try:
            # a file's mtime comes from the kernel's coarse clock, up to a tick behind time.time()
            return progress.stat().st_mtime >= self.started_wall - MTIME_SLACK_S
        except OSError:
            return False

    def poll(self) -> int | None:
        """The exit code if the current incarnation just ended (recorded once), else None."""
        if self.proc is None or self.lifetimes[-1][1] is not None:
            return None
        code = self.proc.poll()
        if code is not None:
            self.lifetimes[-1] = (self.lifetimes[-1][0], time.monotonic())
            if self._reader is not None:
                self._reader.join(timeout=5)
        return code

    def signal(self, sig: int) -> None:
        proc = self._running()
        if proc is not None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 10.0) -> None:
        """SIGCONT (if paused), SIGTERM, then SIGKILL after ``timeout``; waits for the exit."""
        proc = self._running()
        if proc is None:
            self.poll()
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            proc.wait()
        self.poll()

    def alive_seconds(self, now: float) -> float:
        return sum((now if end is None else end) - start for start, end in self.lifetimes)


@dataclass(frozen=True)
class Progress:
    """What a progress file says (launch/progress.py writes it): one line ``STEP MAX_STEPS LOSS``,
    ``MAX_STEPS`` -1 when unbounded and ``LOSS`` nan until one is known."""

    step: int
    max_steps: int | None = None
    loss: float | None = None

    def line(self) -> str:
        return f"{self.step} {self.max_steps or -1} {float('nan') if self.loss is None else self.loss:.6g}"


def read_progress_line(path: Path) -> Progress:
    """A progress file's contents; step 0 when it is missing or unreadable (a file of the older,
    step-only form reads as its step)."""
    try:
        fields = path.read_text().split()
        step = int(fields[0]) if fields else 0
    except (OSError, ValueError):
        return Progress(0)
    try:
        max_steps = int(fields[1]) if len(fields) > 1 else None
        loss = float(fields[2]) if len(fields) > 2 else None
    except ValueError:
        return Progress(step)
    return Progress(step, max_steps if max_steps and max_steps > 0 else None,
                    loss if loss is not None and math.isfinite(loss) else None)


def read_progress(path: Path) -> int:
    return read_progress_line(path).step


def children(pid: int) -> list[int]:
    """The PIDs of ``pid``'s child processes."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def safe_kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
