"""A deterministic run of Decoupled DiLoCo on a virtual clock, in one process.

The synchronizer is the package's own service (``synchronizer/service.py`` and each fragment's
``synchronizer/fragment.py``: seeds and pushes, rounds, quorum and grace window, guard, merge,
outer step, published downlink), given the virtual clock and polled as its closer threads would
poll it; the islands are the package's own learners
(simulate/island.py). What the simulation decides is only *when* things happen: each island's
step time, start, failures and link delays are parameters, and events at one time run in the
order they were scheduled. One seed (the model's, the data's) and one plan reproduce a run
bit for bit.

Not simulated: compute contention between islands (each step takes its planned time) and the
wall-clock cost of a close (``sync_time``, a parameter). A process's start-up is two parameters:
before its join (``start``; for a restart, part of its downtime) and after it (``setup``). A
restarted island starts a fresh inner loop (``make_loop``: new optimizer, data from the start),
as an island without a checkpoint does, and trains the steps it had left.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from lightning_diloco.core.codecs import payload_size
from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.protocol import Contribution, PushAck, RoundRequest, VersionUpdate
from lightning_diloco.reasons import SynchronizerError
from lightning_diloco.simulate.events import EventQueue
from lightning_diloco.simulate.island import InnerLoop, SimIsland
from lightning_diloco.simulate.turns import Answer, Turns
from lightning_diloco.synchronizer.requests import Refusal
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings

LIVENESS_TIMEOUT = 5.0  # seconds, as the launcher runs its synchronizer
HEARTBEAT_EVERY = 1.0  # seconds, as a real island beats


@dataclass(frozen=True)
class IslandPlan:
    """How one island runs on the virtual clock."""

    step_time: float = 0.1
    """Seconds per inner step."""
    start: float = 0.0
    """Seconds after the run's start at which it joins."""
    setup: float = 0.0
    """Seconds from each join to its first step: a real island joins in its strategy's set-up,
    then pulls the global model and starts its training loop and data. It is placed on the run's
    clock at the join, so islands that join together but set up in different times step apart,
    and the first to step stays ahead (nothing moves an island back: the clock follows the lower
    median and only the islands behind it realign)."""
    uplink_latency: float = 0.0
    downlink_latency: float = 0.0
    bandwidth: float = math.inf
    """Bytes per second of each direction of its link (a message takes latency + bytes / bandwidth,
    in order behind the one before it)."""
    failures: tuple[tuple[float, float], ...] = ()
    """(seconds after the run's start at which it dies, seconds until it is back)."""
    jitter: float = 0.0
    """Each step takes step_time x (1 + jitter x a standard normal draw), at least a tenth of it:
    islands of one speed drift out of phase as real ones do (the draws are seeded by the island)."""

    def __post_init__(self) -> None:
        if not (self.step_time > 0 and math.isfinite(self.step_time)):
            raise ValueError(f"step_time={self.step_time}: seconds per inner step must be a positive number")
        if not 0 <= self.jitter < 10:
            raise ValueError(f"jitter={self.jitter}: the step time's relative spread must be in [0, 10)")
        if min(self.start, self.setup, self.uplink_latency, self.downlink_latency) < 0 or not self.bandwidth > 0:
            raise ValueError(f"start={self.start}, setup={self.setup}, latencies ({self.uplink_latency}, {self.downlink_latency}) must be >= 0 "
                             f"and bandwidth={self.bandwidth} > 0")
        for at, down in self.failures:
            if at < 0 or down < 0:
                raise ValueError(f"failure ({at}, {down}): the time it dies and its downtime must be >= 0 seconds")


@dataclass
class SimResult:
    global_model: torch.nn.Module
    """Island 0's model holding the final global fragments."""
    virtual_s: float
    outer_steps: int
    contributions: int
    late: int
    superseded: int
    clipped: int
    """Contributions the guard scaled down (core/guard.py)."""
    skipped: int
    """Due sends an island skipped because the fragment's last send was still in flight."""
    restarts: int
    steps: list[int] = field(default_factory=list)
    """Inner steps each island trained (over all its incarnations)."""

    @property
    def per_outer_step(self) -> float:
        return self.contributions / self.outer_steps if self.outer_steps else 0.0

    @property
    def late_share(self) -> float:
        return self.late / self.contributions if self.contributions else 0.0


class Simulation:
    """``make_loop(island)``: a fresh :class:`InnerLoop` for that island (every island's model must
    start from the same weights); ``plans``: one :class:`IslandPlan` per island; ``steps``: inner
    steps per island; ``sync_time``: seconds a round's close takes (the grace window leaves room for it)."""

    def __init__(self, config: RunConfig, make_loop: Callable[[int], InnerLoop], plans: list[IslandPlan], steps: int,
                 *, sync_time: float = 0.005) -> None:
        if not plans:
            raise ValueError("plans is empty: give one IslandPlan per island")
        if config.merge.min_quorum > len(plans):
            raise ValueError(f"min_quorum={config.merge.min_quorum} exceeds the {len(plans)} islands: no round could close")
        if steps < 1:
            raise ValueError(f"steps={steps}: each island must train at least one inner step")
        self.config, self.make_loop, self.plans, self.steps, self.sync_time = config, make_loop, plans, steps, sync_time
        self.queue = EventQueue()
        self.turns = Turns()
        self.service = Synchronizer(config, SynchronizerSettings(num_islands=len(plans), liveness_timeout=LIVENESS_TIMEOUT,
                                                                 clock=lambda: self.queue.now))
        self.islands: dict[int, SimIsland] = {}  # the live incarnation of each island
        self.incarnation = [0] * len(plans)  # events of a dead incarnation are dropped
        self.trained = [0] * len(plans)
        self.delivered: dict[int, dict[int, int]] = {}
        self.subscribers: dict[int, tuple[Callable[[RoundRequest], None], Callable[[VersionUpdate], None]]] = {}
        self.unanswered: list[Answer] = []  # pushes on their way, or lost with their island's process
        self.link_free: dict[tuple[int, str], float] = {}
        self.polls: set[float] = set()
        self.restarts = 0
        self.skipped = 0  # over the islands' ended incarnations
        self.first_model: torch.nn.Module | None = None
        self.step_draws = [random.Random(island) for island in range(len(plans))]
        self.queue.after_each = self._after_event

    # ---- the network ---------------------------------------------------------------------------

    def _arrival(self, island: int, direction: str, nbytes: int) -> float:
        plan = self.plans[island]
        latency = plan.uplink_latency if direction == "up" else plan.downlink_latency
        at = max(self.queue.now + latency + nbytes / plan.bandwidth, self.link_free.get((island, direction), 0.0))
        self.link_free[(island, direction)] = at
        return at

    def send_push(self, island: int, contribution: Contribution) -> PushAck:
        """The island's push, on its leader's executor: it reaches the service after the uplink's
        delay, and the answer comes back after the downlink's; meanwhile the clock runs."""
        incarnation = self.incarnation[island]
        answer = Answer(self.turns)
        self.unanswered.append(answer)

        def arrive() -> None:
            if self.incarnation[island] != incarnation:
                return  # the process died with its connection
            try:
                ack: PushAck | SynchronizerError = self.service.push(contribution)
            except Refusal as refusal:
                ack = SynchronizerError(None, refusal.reason, str(refusal))
            self.queue.at(self._arrival(island, "down", 0), partial(self._answer, island, incarnation, answer, ack))

        self.queue.at(self._arrival(island, "up", payload_size(contribution.payload)), arrive)
        return answer.wait()

    def _answer(self, island: int, incarnation: int, answer: Answer, ack: PushAck | SynchronizerError) -> None:
        if self.incarnation[island] != incarnation:
            return
        self.unanswered.remove(answer)
        if isinstance(ack, SynchronizerError):
            answer.give(error=ack)
        else:
            answer.give(ack)

    def subscribe(self, island: int, versions: dict[int, int], on_request: Callable[[RoundRequest], None],
                  on_version: Callable[[VersionUpdate], None]) -> None:
        self.delivered[island] = dict(versions)
        self.subscribers[island] = (on_request, on_version)

    def _deliver(self) -> None:
        """What each island's subscription would carry now (synchronizer/delivery.py's loop, one pass)."""
        now, membership = self.queue.now, self.service.membership
        for island, delivered in self.delivered.items():
            incarnation = self.incarnation[island]
            with membership.changed:
                requests = membership.take_requests(island, now)
            events: list[RoundRequest | VersionUpdate] = list(requests)
            for p, fragment in self.service.run.fragments.items():
                if fragment.state is not None and fragment.state.version != delivered.get(p, -1):
                    updates = fragment.updates_for(island, delivered.get(p, -1))
                    for update in updates:
                        delivered[p] = update.version
                    events += updates
            for event in events:
                nbytes = payload_size(event.payload) if isinstance(event, VersionUpdate) else 0
                self.queue.at(self._arrival(island, "down", nbytes), partial(self._receive, island, incarnation, event))

    def _receive(self, island: int, incarnation: int, event: RoundRequest | VersionUpdate) -> None:
        target = self.islands.get(island)
        if target is None or self.incarnation[island] != incarnation:
            return
        on_request, on_version = self.subscribers[island]
        if isinstance(event, VersionUpdate):
            on_version(event)
        else:
            on_request(event)

    # ---- the synchronizer's closers ---------------------------------------------------------------

    def _after_event(self) -> None:
        now = self.queue.now
        self.service.poll(now)
        self.service.run.closers.sync_time = self.sync_time  # the closer measures the wall clock; here it is a parameter
        self._deliver()
        live = self.service.live_islands(now)
        step_time = self.service.membership.step_time(live)
        for fragment in self.service.run.fragments.values():
            with fragment.cond:
                decision = fragment.rounds.decide(fragment.state, now, live, step_time, self.sync_time, self.service.run.quorum())
            if decision.deadline is not None and decision.deadline > now and decision.deadline not in self.polls:
                self.polls.add(decision.deadline)
                self.queue.at(decision.deadline, partial(self.polls.discard, decision.deadline))
        # liveness runs out without an event of its own: look again when the next island would time out
        for member in list(self.service.membership.members.values()):
            expires = member.last_seen + LIVENESS_TIMEOUT + 1e-9
            if expires > now and not member.left and expires not in self.polls:
                self.polls.add(expires)
                self.queue.at(expires, partial(self.polls.discard, expires))

    # ---- islands ----------------------------------------------------------------------------------

    def _join(self, island: int) -> None:
        self.incarnation[island] += 1
        incarnation = self.incarnation[island]
        loop = self.make_loop(island)
        self._schedule_step(island, after=self.plans[island].setup)  # before its first heartbeat, at a tie
        sim_island = SimIsland(island, loop, self.service, self, len(self.plans), self.plans[island].step_time,
                               HEARTBEAT_EVERY, alive=lambda: self.incarnation[island] == incarnation)
        self.islands[island] = sim_island
        if island == 0 and self.first_model is None:
            self.first_model = loop.model

    def _schedule_step(self, island: int, after: float = 0.0) -> None:
        """The island's next step ends a step time after ``after`` seconds from now."""
        incarnation, plan = self.incarnation[island], self.plans[island]
        factor = max(0.1, 1.0 + plan.jitter * self.step_draws[island].gauss(0.0, 1.0)) if plan.jitter else 1.0
        self.queue.at(self.queue.now + after + plan.step_time * factor, lambda: self._step(island, incarnation))

    def _step(self, island: int, incarnation: int) -> None:
        target = self.islands.get(island)
        if target is None or self.incarnation[island] != incarnation:
            return
        target.train_step()
        self.trained[island] += 1
        if self.incarnation[island] != incarnation:
            return  # it died while it waited for its rounds (synchronous DiLoCo)
        if self.trained[island] >= self.steps:
            target.finish()
            self.skipped += target.learner.counters["skipped"]
            if self.islands.get(island) is target:
                del self.islands[island]
                self.delivered.pop(island, None)
            return
        self._schedule_step(island)

    def _die(self, island: int, down: float) -> None:
        if island not in self.islands:
            return  # already done
        self.incarnation[island] += 1  # drops its pending steps, beats, pushes and deliveries
        self.skipped += self.islands.pop(island).learner.counters["skipped"]
        self.delivered.pop(island, None)
        self.restarts += 1
        self.queue.at(self.queue.now + down, lambda: self._join(island))

    # ---- the run ----------------------------------------------------------------------------------

    def run(self) -> SimResult:
        for island, plan in enumerate(self.plans):
            self.queue.at(plan.start, partial(self._join, island))
            for at, down in plan.failures:
                self.queue.at(at, partial(self._die, island, down))
        try:
            self.queue.run()
        finally:  # pushes of processes that died (or of a run that failed): their threads end now
            for answer in self.unanswered:
                answer.give(error=ConnectionError("the island's process died"))
            self.turns.join()
        model = self.first_model
        assert model is not None
        with torch.no_grad():
            named = dict(model.named_parameters())
            state = self.service.run.state
            if state is None:
                raise RuntimeError("no island of the simulated run joined its synchronizer: there is no model to evaluate")
            layout = state.layout
            for p, members in enumerate(layout.fragments):
                _, value = self.service.pull(p)
                offset = 0
                for i in members:
                    tensor = named[layout.specs[i].name]
                    tensor.copy_(value[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
        status = self.service.status()
        rounds = [fragment.round_status() for fragment in self.service.run.fragments.values()]
        return SimResult(global_model=model, virtual_s=self.queue.now, outer_steps=status.outer_steps,
                         contributions=sum(r.merged_entries for r in rounds), late=sum(r.merged_late for r in rounds),
                         superseded=sum(r.superseded for r in rounds), clipped=sum(r.clipped for r in rounds),
                         skipped=self.skipped, restarts=self.restarts, steps=list(self.trained))
