"""Declarative, seeded fault schedules.

A schedule is a list of faults separated by ``;`` or newlines (a file given as ``@path``)::

    kill 1 at 10s              SIGKILL island 1 ten seconds after the start
    kill 1 at step 200         ... once island 1 reports 200 inner steps
    kill 1 at 10s for 20s      ... and keep it down 20 s before the launcher restarts it
    pause 2 at 15s for 5s      SIGSTOP island 2, SIGCONT it 5 s later (a straggler)
    kill-synchronizer at 20s   SIGKILL the synchronizer; it restarts from its checkpoint
    random mtbf 30s seed 3     kills of random islands, exponential gaps of mean 30 s

Parsing is pure; the launcher fires the faults and counts each one that fired.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Fault:
    kind: str
    island: int | None = None
    at_s: float | None = None
    at_step: int | None = None
    duration_s: float = 0.0

    def describe(self) -> str:
        who = "synchronizer" if self.island is None else f"island {self.island}"
        when = f"{self.at_s:g}s" if self.at_s is not None else f"step {self.at_step}"
        extra = f" for {self.duration_s:g}s" if self.duration_s else ""
        return f"{self.kind} {who} at {when}{extra}"


_SECONDS = r"(\d+(?:\.\d+)?)s"
_PATTERNS = [
    (re.compile(rf"^(kill|pause) (\d+) at {_SECONDS}(?: for {_SECONDS})?$"), "time"),
    (re.compile(rf"^(kill|pause) (\d+) at step (\d+)(?: for {_SECONDS})?$"), "step"),
    (re.compile(rf"^kill-synchronizer at {_SECONDS}$"), "sync"),
    (re.compile(rf"^random mtbf {_SECONDS}(?: seed (\d+))?$"), "random"),
]


def parse_schedule(text: str, *, num_islands: int, horizon_s: float = 3600.0) -> list[Fault]:
    """Faults sorted by time (step-triggered ones last). ``@path`` reads the schedule from a file.

    ``horizon_s`` bounds how far ahead random faults are drawn.
    """
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    faults: list[Fault] = []
    for raw in re.split(r"[;\n]", text):
        item = " ".join(raw.split("#", 1)[0].split()).lower()
        if not item:
            continue
        faults.extend(_parse_item(item, num_islands, horizon_s))
    for f in faults:
        if f.island is not None and not 0 <= f.island < num_islands:
            raise ValueError(f"fault '{f.describe()}' names island {f.island}, but the run has islands 0..{num_islands - 1}")
        if f.kind == "pause" and f.duration_s <= 0:
            raise ValueError(f"fault '{f.describe()}' needs a duration: 'pause ISLAND at Ts for Ds'")
    return sorted(faults, key=lambda f: (f.at_s is None, f.at_s or 0.0, f.at_step or 0))


def _parse_item(item: str, num_islands: int, horizon_s: float) -> list[Fault]:
    for pattern, form in _PATTERNS:
        m = pattern.match(item)
        if not m:
            continue
        if form == "time":
            return [Fault(m[1], int(m[2]), at_s=float(m[3]), duration_s=float(m[4] or 0))]
        if form == "step":
            return [Fault(m[1], int(m[2]), at_step=int(m[3]), duration_s=float(m[4] or 0))]
        if form == "sync":
            return [Fault("kill-synchronizer", None, at_s=float(m[1]))]
        return random_kills(float(m[1]), num_islands, horizon_s, random.Random(int(m[2] or 0)))
    raise ValueError(
        f"cannot read fault {item!r}; use 'kill I at Ts', 'kill I at step N', 'pause I at Ts for Ds', "
        "'kill-synchronizer at Ts' or 'random mtbf Ts [seed S]'"
    )


def random_kills(mtbf_s: float, num_islands: int, horizon_s: float, rng: random.Random) -> list[Fault]:
    """Kills of uniformly chosen islands with exponential gaps of mean ``mtbf_s`` up to the horizon."""
    if mtbf_s <= 0:
        raise ValueError(f"mtbf must be positive, got {mtbf_s}s")
    faults: list[Fault] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return faults
        faults.append(Fault("kill", rng.randrange(num_islands), at_s=round(t, 3)))


def due_faults(pending: list[Fault], elapsed_s: float, steps: dict[int, int]) -> list[Fault]:
    """The pending faults that should fire now, given the time and each island's steps."""
    return [
        f for f in pending
        if (f.at_s is not None and elapsed_s >= f.at_s)
        or (f.at_step is not None and f.island is not None and steps.get(f.island, 0) >= f.at_step)
    ]
