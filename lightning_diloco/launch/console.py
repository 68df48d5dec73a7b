"""What the launcher prints while a run goes on.

By default every line the islands and the synchronizer print, prefixed with its name. With
``--progress-every S`` (the recipes' default) each process's output goes to ``WORKDIR/NAME.log``
instead and the terminal gets one progress line every S seconds (steps, training loss, outer
steps), plus the warnings and errors, each distinct one once: M islands otherwise print every
Lightning banner and tip M times and nothing about how training goes.
"""

from __future__ import annotations

import re
import statistics
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from lightning_diloco.core.protocol import SynchronizerStatus
from lightning_diloco.launch.supervisor import Progress

# Lines shown in progress mode: a problem, said by Python, by our logging or by a launcher.
_SHOWN = re.compile(r"Traceback|Error|ERROR|WARNING|refused|Killed")
_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ")


class Console:
    def __init__(self, write: Callable[[str], None], workdir: Path, progress_every: float) -> None:
        """``write``: the terminal (thread-safe). ``progress_every``: seconds between progress
        lines; 0 prints every process's output instead."""
        self.write, self.workdir, self.progress_every = write, workdir, progress_every
        self._logs: dict[str, IO[str]] = {}
        self._shown: set[str] = set()
        self._lock = threading.Lock()

    @property
    def quiet(self) -> bool:
        return self.progress_every > 0

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name.replace(' ', '-')}.log"

    def output_of(self, name: str) -> Callable[[str], None]:
        """Where a process's output lines go."""
        if not self.quiet:
            return lambda line: self.write(f"[{name}] {line}")

        def echo(line: str) -> None:
            with self._lock:
                if name not in self._logs:
                    self._logs[name] = open(self.log_path(name), "a", buffering=1)
                self._logs[name].write(line)
                text = _TIMESTAMP.sub("", line.strip())
                show = bool(_SHOWN.search(text)) and text not in self._shown
                if show:
                    self._shown.add(text)
            if show:
                self.write(f"[{name}] {line}")

        return echo

    def close(self) -> None:
        with self._lock:
            for f in self._logs.values():
                f.close()
            self._logs.clear()


def progress_line(elapsed: float, progress: dict[int, Progress], activity: dict[int, str],
                  status: SynchronizerStatus | None, unit: str = "island") -> str:
    """One line: where the islands are (steps, of how many), their training loss, the run's outer
    steps, and how many are training (``activity``: each one's :meth:`Supervised.activity`), naming
    the others."""
    steps = [p.step for p in progress.values()]
    parts = [f"[progress] {elapsed:.0f}s"]
    if not any(steps):
        parts.append("starting (imports, data, joining)")
    else:
        low, high = min(steps), max(steps)
        total = max((p.max_steps for p in progress.values() if p.max_steps), default=None)
        span = f"{low}" if low == high else f"{low}-{high}"
        parts.append(f"steps {span}" + (f" of {total}" if total else ""))
    losses = [p.loss for p in progress.values() if p.loss is not None]
    if losses:
        parts.append(f"train loss {statistics.fmean(losses):.3f}")
    if status is not None:
        parts.append(f"outer steps {status.outer_steps}")
    training = sum(a == "training" for a in activity.values())
    others = [f"{unit} {i} {a}" for i, a in sorted(activity.items()) if a != "training"]
    line = f"{training}/{len(activity)} {unit}s training"
    if others and training:
        line += " (" + ", ".join(others) + ")"
    parts.append(line)
    return ", ".join(parts) + "\n"
