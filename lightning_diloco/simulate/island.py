"""One simulated island: the package's own :class:`IslandLearner` around a copy of the model, its
links to the synchronizer replaced by events on the virtual clock.

What is the real island's code here: every decision at a step boundary (what is due, realigning on
the run's clock, skipping a fragment in flight, replacing a late send, when to apply and how), the
uplink's encoding with error feedback, the inbox that sums deltas, the apply rules and the end of
the run. What the simulation puts in its place: the push thread (:class:`SimLeader`, which encodes
on the island's step as the real one does on its pool, and hands the push to the clock), the
subscription (the synchronizer's deliveries are events), the heartbeat thread (an event every
``heartbeat_every`` virtual seconds) and the waits on the inbox (:class:`SimInbox`, which runs the
clock instead of sleeping).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_diloco.core.codecs import DEFAULT_DENSITY, EXACT, get_codec
from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.fragments import build_layout, tensor_specs
from lightning_diloco.core.protocol import Beat, Contribution, PushAck
from lightning_diloco.learner.inbox import Inbox
from lightning_diloco.learner.island import IslandLearner
from lightning_diloco.learner.leader import LeaderSync
from lightning_diloco.learner.staging import HostCopy
from lightning_diloco.simulate.events import EventQueue

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

    def send_push(self, island: int, contribution: Contribution, ack: Future) -> None: ...
    def subscribe(self, island: int, versions: dict[int, int]) -> None: ...


class SimInbox(Inbox):
    """The real inbox, whose waits run the virtual clock: the other islands train on while this one
    waits for its rounds (synchronous DiLoCo, the end of a run)."""

    def __init__(self, versions: list[int], numels: list[int], block_size: int, queue: EventQueue,
                 sparse_density: float = DEFAULT_DENSITY) -> None:
        super().__init__(versions, numels, block_size, sparse_density)
        self.queue = queue

    def wait(self, condition: Callable[[], bool], timeout: float) -> bool:
        return self.queue.run_until(condition, self.queue.now + timeout)


class SimLink:
    """The calls an island makes and is answered at once (join's start, pulls, heartbeats, leave):
    direct calls on the synchronizer service, with the island's session."""

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
        raise AssertionError("a simulated island pushes through SimLeader, on the clock")

    def subscribe(self, island: int, versions: Callable[[], dict[int, int]], **_: Any) -> None:
        self.network.subscribe(island, versions())

    def leave(self, island: int) -> None:
        self.service.leave(island, session=self.session)

    def close(self) -> None:
        pass


class SimLeader(LeaderSync):
    """The leader's pushes as events: encoded now (as the real pool does within the step), then
    delivered to the synchronizer after the link's delay, the ack back after the other way's."""

    def __init__(self, link: SimLink, *, island: int, config: RunConfig, layout_hash: str) -> None:
        codec = config.codec
        super().__init__(link, island=island, uplink=get_codec(codec.uplink, codec.block_size, codec.sparse_density), feedback=codec.uplink_feedback,
                         layout_hash=layout_hash, workers=1, progress=lambda: (0, 0.0, 0))
        self.sim_link = link

    def start_heartbeat(self) -> None:
        pass  # the simulation beats for it

    def push(self, *, fragment: int, round: int, local: torch.Tensor | HostCopy, base: torch.Tensor | None, base_version: int,
             tokens: float, steps: int, seq: int) -> Future:
        payload = self.encode(fragment, local, base)
        ack: Future = Future()
        ack.add_done_callback(self._count_ack)
        self.sim_link.network.send_push(self.island, Contribution(
            island=self.island, fragment=fragment, round=round, base_version=base_version, tokens=max(tokens, 1.0),
            steps=max(steps, 1), codec=self.uplink.name, seq=seq, payload=payload, layout_hash=self.layout_hash,
            session=self.sim_link.session), ack)
        return ack

    def _count_ack(self, ack: Future) -> None:
        if ack.exception() is None:
            self.late += ack.result().late

    def close(self) -> None:
        self._leave()


class SimIsland:
    """One incarnation of island ``index``: a fresh inner loop (model, optimizer, data from the
    start) whose learner joins the service, pulls the global model and trains ``steps_left`` steps."""

    def __init__(self, index: int, loop: InnerLoop, service: Synchronizer, network: Network, num_islands: int,
                 step_time: float) -> None:
        self.index, self.loop, self.step_time = index, loop, step_time
        specs = tensor_specs(loop.model)
        named = dict(loop.model.named_parameters())
        info = service.join(index, 1, specs, num_islands=num_islands)
        config = info.config
        layout = build_layout(specs, config.schedule.num_fragments)
        link = SimLink(service, network, info.session)
        self.learner = IslandLearner([named[s.name] for s in specs], layout, config, island=index, link=link,
                                     push_wait=math.inf)
        self.learner.leader = SimLeader(link, island=index, config=config, layout_hash=layout.hash)
        self.learner.seq = 0  # a new session: its sequence numbers start afresh (the real one's come from the wall clock)
        with torch.no_grad():
            self.learner.start(run_step=info.run_step)
        numels = [layout.fragment_numel(p) for p in range(layout.num_fragments)]
        self.learner.inbox = SimInbox(self.learner.versions, numels, config.codec.block_size, network.queue, config.codec.sparse_density)
        self.learner._step_time = step_time

    def train_step(self) -> None:
        with torch.enable_grad():  # it may run inside another island's wait, which holds no_grad
            tokens = self.loop.step()
        with torch.no_grad():
            self.learner.after_step(tokens)
        self.learner._step_time = self.step_time  # virtual, not the wall clock's

    def finish(self) -> None:
        """The real end of an island's run: wait for its last rounds (on the clock), load the global
        model if it holds this island's work, leave the run."""
        with torch.no_grad():
            self.learner.finish()
        self.learner.close()
