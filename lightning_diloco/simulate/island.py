"""One simulated island: the package's own :class:`IslandLearner` around a copy of the model, given
a virtual clock, an executor that takes turns with it and a link whose messages are events.

All of the island is the real one's code: every decision at a step boundary (what is due,
realigning on the run's clock, skipping a fragment in flight, replacing a late send, when to
apply and how), the leader's pushes (the uplink's encoding with error feedback, on its executor)
and heartbeat, the inbox that chains deltas, its waits, the apply rules and the end of the run. What
the simulation gives it in place of the machine's: its clock (:class:`IslandClock`: waits run the
event queue, the heartbeat is an event every ``heartbeat_every`` virtual seconds), its executor
(simulate/turns.py) and its link (:class:`SimLink`: calls answered at once, pushes and the
subscription's deliveries carried over the simulated network).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from lightning_diloco.core.codecs import EXACT, get_codec
from lightning_diloco.core.fragments import build_layout, tensor_specs
from lightning_diloco.core.protocol import Beat, Contribution, PushAck, RoundRequest, VersionUpdate
from lightning_diloco.learner.island import IslandLearner
from lightning_diloco.simulate.events import EventQueue
from lightning_diloco.simulate.turns import TurnExecutor, Turns

if TYPE_CHECKING:
    from lightning_diloco.synchronizer.service import Synchronizer


class InnerLoop(Protocol):
    """What an island trains: ``model``'s trainable parameters are the ones synchronized, and
    ``step()`` takes one inner step (forward, backward, optimizer and scheduler) and returns the
    tokens it consumed (the merge weights grow with them)."""

    model: torch.nn.Module

    def step(self) -> float: ...


class Network(Protocol):
    """Where a simulated island's messages go: the simulation (run.py)."""

    queue: EventQueue
    turns: Turns

    def send_push(self, island: int, contribution: Contribution) -> PushAck: ...
    def subscribe(self, island: int, versions: dict[int, int], on_request: Callable[[RoundRequest], None],
                  on_version: Callable[[VersionUpdate], None]) -> None: ...


class IslandClock:
    """One incarnation of an island's clock: the event queue's virtual time. A wait runs the
    queue (the other islands train on meanwhile); what the island repeats is an event, dropped
    once ``alive()`` is False (the process died, and its threads with it)."""

    def __init__(self, queue: EventQueue, alive: Callable[[], bool]) -> None:
        self.queue, self.alive = queue, alive

    def now(self) -> float:
        return self.queue.now

    def time(self) -> float:
        return self.queue.now

    def wait(self, cond: threading.Condition, ready: Callable[[], bool], timeout: float) -> bool:
        return self.queue.run_until(ready, self.queue.now + timeout)

    def every(self, seconds: float, action: Callable[[], None], *, until: threading.Event,
              name: str) -> Callable[[float], None]:
        def run() -> None:
            if until.is_set() or not self.alive():
                return
            action()
            self.queue.at(self.queue.now + seconds, run)

        self.queue.at(self.queue.now + seconds, run)
        return lambda timeout: None  # nothing runs between events


class SimLink:
    """The island's :class:`~lightning_diloco.learner.link.SynchronizerLink`: its calls are direct
    calls on the synchronizer service, with the island's session, answered at once, but pushes,
    which cross the simulated network (called on the leader's executor, they block until the
    answer comes back), and the subscription, whose deliveries are events."""

    def __init__(self, service: Synchronizer, network: Network, session: str) -> None:
        self.service, self.network, self.session = service, network, session

    def heartbeat(self, island: int, steps: int, step_time: float, schedule_step: int = 0) -> Beat:
        return self.service.heartbeat(island, steps, step_time, schedule_step, session=self.session)

    def seed(self, island: int, fragment: int, value: torch.Tensor) -> tuple[bool, int]:
        seeded = self.service.seed(island, fragment, get_codec(EXACT).encode(value), session=self.session)
        return seeded, self.service.versions()[fragment]

    def pull(self, fragment: int) -> tuple[int, torch.Tensor]:
        return self.service.pull(fragment)

    def push(self, contribution: Contribution) -> PushAck:
        return self.network.send_push(contribution.island, dataclasses.replace(contribution, session=self.session))

    def subscribe(self, island: int, versions: Callable[[], dict[int, int]], *,
                  on_request: Callable[[RoundRequest], None], on_version: Callable[[VersionUpdate], None],
                  on_reconnect: Callable[[], None] = lambda: None) -> None:
        self.network.subscribe(island, versions(), on_request, on_version)  # never reconnects

    def leave(self, island: int) -> None:
        self.service.leave(island, session=self.session)

    def close(self) -> None:
        pass


class SimIsland:
    """One incarnation of island ``index``: a fresh inner loop (model, optimizer, data from the
    start) whose learner joins the service, pulls the global model and trains ``steps_left`` steps.
    ``alive()``: whether this incarnation still runs."""

    def __init__(self, index: int, loop: InnerLoop, service: Synchronizer, network: Network, num_islands: int,
                 step_time: float, heartbeat_every: float, alive: Callable[[], bool]) -> None:
        self.index, self.loop = index, loop
        specs = tensor_specs(loop.model)
        named = dict(loop.model.named_parameters())
        info = service.join(index, 1, specs, num_islands=num_islands)
        layout = build_layout(specs, info.config.schedule.num_fragments)
        self.learner = IslandLearner(
            [named[s.name] for s in specs], layout, info.config, island=index, link=SimLink(service, network, info.session),
            heartbeat_every=heartbeat_every, push_wait=float("inf"), clock=IslandClock(network.queue, alive),
            executor=TurnExecutor(network.turns, f"island{index}-sync"), step_time=step_time)
        with torch.no_grad():
            self.learner.start(run_step=info.run_step)

    def train_step(self) -> None:
        with torch.enable_grad():  # it may run inside another island's wait, which holds no_grad
            tokens = self.loop.step()
        with torch.no_grad():
            self.learner.after_step(tokens)

    def finish(self) -> None:
        """The real end of an island's run: wait for its last rounds (on the clock), load the global
        model if it holds this island's work, leave the run."""
        with torch.no_grad():
            self.learner.finish()
        self.learner.close()
