"""What one learner island does around its inner steps: snapshot, send, apply (docs/algorithm.md#the-learner).

Framework-free: the Lightning strategy feeds it the model's parameters, calls :meth:`after_step`
after every inner optimizer step, and provides the island's collectives. Only the leader (rank 0
of the island) talks to the synchronizer; every decision that changes the parameters is made by
the leader and broadcast, so all ranks apply the same fragment at the same step and enter the
same collectives in the same order.

The island follows the run's clock: its *schedule step* starts at the run's step when it joins
and jumps forward when the synchronizer asks for a round it has not reached yet, so it sends each
fragment in the same round as every other island. Each fragment's send and apply are its
:class:`~lightning_diloco.learner.fragment.IslandFragment`'s; the island plans each step
boundary and routes the plan to them. The end of the run: :meth:`IslandLearner.finish` (end_of_run.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.fragments import FragmentLayout
from lightning_diloco.core.schedule import due_fragment, fragment_offsets, round_of
from lightning_diloco.core.sparse_codec import DENSE_CODEC, dense_fragments, prepare_kernels
from lightning_diloco.core.threads import torch_on_this_thread
from lightning_diloco.learner.clock import SYSTEM_CLOCK, Clock
from lightning_diloco.learner.collective import Collective
from lightning_diloco.learner.end_of_run import end_of_run, final_wait
from lightning_diloco.learner.fragment import Apply, Flight, IslandFragment, fragments_state_dict, load_fragments
from lightning_diloco.learner.inbox import Inbox
from lightning_diloco.learner.leader import LeaderSync, sync_pool
from lightning_diloco.learner.link import SynchronizerLink
from lightning_diloco.learner.shards import IslandShards

log = logging.getLogger(__name__)

STATE_FORMAT = 2
COUNTERS = ("sent", "applied", "received", "skipped", "failed", "requested", "realigned", "unmerged")


@dataclass(kw_only=True, frozen=True)
class StepPlan:
    """What the island does at one step boundary (the leader's decisions, carried out by every rank)."""

    schedule_step: int
    fail: list[int]
    """Fragments whose send failed: their flight ends without a version."""
    send: list[tuple[int, int]]
    """(fragment, round) to send now."""
    apply: list[Apply]
    gather: list[int]
    """Fragments (at most one) to gather whole after the applies, for the leader to give back to a
    restarted synchronizer: their parts are on every rank (sharded), so every rank gathers."""


class IslandLearner:
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: FragmentLayout,
        config: RunConfig,
        *,
        island: int,
        link: SynchronizerLink | None = None,
        collective: Collective | None = None,
        heartbeat_every: float = 1.0,
        push_wait: float = 120.0,
        clock: Clock = SYSTEM_CLOCK,
        executor: Executor | None = None,
        step_time: float | None = None,
    ) -> None:
        """``params``: the model's trainable tensors in ``layout.specs`` order, whole or sharded
        (DTensors: see :mod:`~lightning_diloco.learner.shards`). ``link``: the
        synchronizer (a :class:`~lightning_diloco.transport.client.SynchronizerClient`) on the
        leader, None on other ranks. ``push_wait``: seconds a sent fragment may wait for the
        version of its round before the send counts as failed and may be sent again.

        ``clock``: the island's time (learner/clock.py); ``executor``: where the leader's pushes
        run (default :func:`~lightning_diloco.learner.leader.sync_pool`, shut down at
        :meth:`close`); ``step_time``: seconds per inner step, when known in advance (the
        simulation's plan): reported as it is instead of measured between step boundaries."""
        assert len(params) == len(layout.specs), f"{len(params)=} != {len(layout.specs)=}"
        self.params, self.layout, self.config = list(params), layout, config
        self.island, self.link, self.clock = island, link, clock
        self.collective = collective or Collective()
        self.is_leader = link is not None
        self.shards = IslandShards(self.params, layout, self.collective, leader=self.is_leader)
        sched = config.schedule
        self.offsets = fragment_offsets(layout.num_fragments, sched.sync_every)
        codec = config.codec
        self.uplink = get_codec(codec.uplink, codec.block_size, codec.sparse_density)
        uplink_of = {}  # fragments whose pushes go in another codec than the uplink's
        if codec.sparse_dense_tensors:  # checked whichever way is sparse: the downlink's go by the same names
            dense = get_codec(DENSE_CODEC, codec.block_size)
            named = dense_fragments(layout, codec.sparse_dense_tensors)
            uplink_of = {p: dense for p in named} if codec.uplink == "sparse" else {}
        if self.is_leader and "sparse" in (codec.uplink, codec.downlink):
            prepare_kernels()  # before training, not in the first push
        self.push_wait = push_wait

        P = layout.num_fragments
        self.step = 0
        self.schedule_step = 0
        self.fragments = [IslandFragment(p, self.shards, sched, self.shards.read(p)) for p in range(P)]  # local parts
        self.seq = int(clock.time() * 1e6)  # increasing across restarts: the synchronizer dedups by it
        self.merged_any = False  # a contribution of this island is in the global model
        self._lock = threading.Lock()  # counters: written by the training thread, read by metrics() from any
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.blocked_s = 0.0  # seconds in the sync hook: its own copies and applies, and any wait below
        self.network_wait_s = 0.0  # of them, waiting for rounds to close (synchronous DiLoCo, tau = 0, only)
        self.staleness = 0
        self._step_time = step_time or 0.0
        self._measure_step_time = step_time is None
        self._last_step_at: float | None = None

        self.inbox: Inbox | None = None  # the leader's, from start()
        self._seen_reconnects = 0
        self._realigned_at: int | None = None  # the inner step of the last realignment
        self.leader: LeaderSync | None = None
        if link is not None:
            self.leader = LeaderSync(
                link, island=island, uplink=self.uplink, feedback=config.codec.uplink_feedback, layout_hash=layout.hash,
                executor=executor or sync_pool(island, min(P, sched.overlap_steps + 2)), progress=self._progress,
                heartbeat_every=heartbeat_every, holds=lambda p: self.fragments[p].held(), clock=clock, uplink_of=uplink_of,
            )
        # where the uplink's residual goes: into the parameters at the apply (the leader takes it
        # out of its feedback and shares it with the ranks), or into the next push (None)
        self._residuals = (self.leader.feedback if self.leader is not None and config.codec.uplink_residual == "parameters"
                           else None)

    @property
    def versions(self) -> list[int]:
        return [f.version for f in self.fragments]

    @property
    def in_flight(self) -> dict[int, Flight]:
        """Fragment -> its send in flight (a view: the fragments own them)."""
        return {f.number: f.flight for f in self.fragments if f.flight is not None}

    @property
    def reachable(self) -> bool:
        return self.leader.reachable if self.leader else True

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _progress(self) -> tuple[int, float, int]:
        """(steps, step time, schedule step): what a heartbeat tells the synchronizer."""
        return self.step, self._step_time, self.schedule_step

    def _share(self, obj: Any) -> Any:
        """The leader's ``obj`` on every rank of the island."""
        return self.collective.broadcast_object(obj)

    def _started_leader(self) -> tuple[LeaderSync, Inbox] | None:
        """The leader's sync and inbox; None on the other ranks."""
        if self.leader is None:
            return None
        if self.inbox is None:
            raise RuntimeError("IslandLearner.start() opens the island's subscription: call it once, before the first "
                               "after_step() or finish()")
        return self.leader, self.inbox

    # ---- joining ----------------------------------------------------------------------------

    def start(self, resume: dict | None = None, run_step: int = 0) -> None:
        """Seed unseeded fragments, pull every global fragment and start from the global model,
        at the run's step (``run_step`` from the join, or later, or the resumed one).

        With ``resume`` (a :meth:`state_dict`), fragments whose global version is still the one
        saved keep their local values and counters: the run continues as if never stopped.
        """
        if resume is not None:
            self.load_state_dict(resume)
        link = self.link
        beat = link.heartbeat(self.island, self.step, 0.0, self.schedule_step) if link is not None else None
        for p in self._share(sorted(p for p, v in beat.versions.items() if v < 0) if beat is not None else None):
            whole = self.shards.gather(p, self.shards.read(p))  # the first island seeds the global model
            if link is not None:
                assert whole is not None, "IslandShards.gather returns the whole fragment on the leader"
                link.seed(self.island, p, whole)
        # pull the fragments of the shards that answered; start at the run's step, unless this
        # island's own (resumed) clock is ahead of it
        pull, schedule_step = self._share(([p for p in range(self.layout.num_fragments) if p in beat.versions],
                                           max(self.schedule_step, run_step, beat.run_step)) if beat is not None else None)
        if resume is None:
            for f in self.fragments:
                if f.number not in pull:  # its shard is not answering: trained locally, sent once a version arrives
                    f.version = -1
        adopted = 0
        for p in pull:  # one fragment at a time: no rank ever holds the whole global model
            pulled = link.pull(p) if link is not None else None
            version = self._share(pulled[0] if pulled is not None else None)
            f = self.fragments[p]
            if resume is not None and resume["versions"][p] == version:
                f.version = version  # nothing merged since our checkpoint: its base and counters hold
                continue
            value = self.shards.scatter(p, pulled[1] if pulled is not None else None)
            f.adopt(value, version)
            self.shards.write(p, value)
            adopted += 1
            del pulled
        self.schedule_step = schedule_step
        if link is not None and self.leader is not None:
            numels = [self.layout.fragment_numel(p) for p in range(self.layout.num_fragments)]
            self.inbox = Inbox(self.versions, numels, self.config.codec.block_size, self.config.codec.sparse_density,
                               clock=self.clock, max_steps=self.config.merge.history, on_summed=self.leader.want_whole)
            self.leader.inbox = self.inbox
            for f in self.fragments:
                if f.version >= 0 and not f.exact:  # resumed off the published value (summed steps): pulled whole
                    self.inbox.ask_whole(f.number)
            link.subscribe(self.island, self.inbox.held, on_request=self.inbox.on_request,
                           on_version=self.inbox.on_version, on_reconnect=self.inbox.on_reconnect)
            self.leader.start_heartbeat()
        log.info("island %d joined at schedule step %d, versions %s (%d fragments from the global model)",
                 self.island, self.schedule_step, self.versions, adopted)

    # ---- the inner-step hook ------------------------------------------------------------------

    def after_step(self, tokens: float) -> None:
        """Call after every inner optimizer step with the tokens this rank consumed in it."""
        with torch_on_this_thread():  # its copies are short: not worth waking the training loop's thread team
            self._step_boundary(tokens)

    def _step_boundary(self, tokens: float) -> None:
        started = self.clock.now()
        if self._measure_step_time and self._last_step_at is not None:
            dt = started - self._last_step_at
            self._step_time = dt if not self._step_time else 0.9 * self._step_time + 0.1 * dt
        self.step += 1
        self.schedule_step += 1
        island_tokens = tokens * self.collective.world_size  # ranks see equal shards
        for f in self.fragments:
            f.stepped(island_tokens)
        leader = self._started_leader()
        plan: StepPlan = self._share(self._plan(*leader) if leader is not None else None)
        self.schedule_step = plan.schedule_step
        for p in plan.fail:
            self.fragments[p].flight = None  # (the leader's plan ended it there already)
        for p, r in plan.send:
            if self.is_leader:
                self.seq += 1
            self.fragments[p].send(r, apply_at=self.step + self._overlap(), clock=self.clock, leader=self.leader,
                                   seq=self.seq, inbox=self.inbox)
            self._count("sent")
        applies = plan.apply
        if self._overlap() == 0 and plan.send:  # synchronous DiLoCo waits for its rounds
            waited_from = self.clock.now()
            sent = [p for p, _ in plan.send]
            applies = applies + self._share(self._await_rounds(leader[1], sent) if leader is not None else None)
            self.network_wait_s += self.clock.now() - waited_from
        for a in applies:
            self.staleness = self.fragments[a.fragment].apply(a)
            self.merged_any = self.merged_any or a.included
            self._count("applied" if a.ends_flight else "received")
        for p in plan.gather:
            held = self.fragments[p].gather_held()
            if self.leader is not None:
                assert held is not None, "IslandFragment.gather_held returns the whole fragment on the leader"
                self.leader.hold_gathered(p, *held)
        self._last_step_at = self.clock.now()
        self.blocked_s += self._last_step_at - started

    def _overlap(self) -> int:
        """tau at this step: 0 during the synchronous warm start (``synchronous_steps``)."""
        sched = self.config.schedule
        return 0 if self.schedule_step <= sched.synchronous_steps else sched.overlap_steps

    def _plan(self, leader: LeaderSync, inbox: Inbox) -> StepPlan:
        """The leader's decisions for this step boundary: realign, give up, send, apply. A flight
        given up ends here on the leader (on the other ranks when they carry the plan out), so
        that the decisions after it see its fragment free."""
        H = self.config.schedule.sync_every
        requests = inbox.take_requests()
        furthest = max((r.due_step for r in requests.values()), default=-1)
        # the run is ahead of us: skip to its step, at most once per H of our own steps (the
        # synchronizer asks only for rounds due on the run's clock; this holds even if it did not,
        # so no request can carry this island's clock more than a round past its own steps per H)
        if furthest > self.schedule_step and (self._realigned_at is None or self.step - self._realigned_at >= H):
            self.schedule_step = furthest
            self._realigned_at = self.step
            self._count("realigned")
        wanted = {p: r.round for p, r in requests.items()}
        due = due_fragment(self.schedule_step, self.offsets, H)
        if due is not None:
            wanted[due] = max(wanted.get(due, -1), round_of(self.schedule_step, H))
        fail = self._give_up_failed_flights(leader)
        send = []
        for p, r in sorted(wanted.items()):
            f = self.fragments[p]
            if f.version < 0:
                continue  # no global version yet (its shard was away at the join): nothing to send against
            if f.sent_round >= r:
                continue  # already sent for that round (asked for it, then due by our own clock)
            if f.blocks_send(r):
                self._count("skipped")
                continue
            send.append((p, r))
            if p in requests:
                self._count("requested")
        reconnected = inbox.reconnects != self._seen_reconnects
        self._seen_reconnects = inbox.reconnects
        if reconnected:  # what waited in rounds may be gone with a restarted synchronizer
            for f in self.fragments:
                if f.flight is not None:
                    f.flight = None
                    fail.append(f.number)
                    self._count("failed")
        # synchronous DiLoCo waits for the version of each round it sends for now: a version of
        # such a fragment that came before stays in the inbox, where that one supersedes it (taken
        # here as well, it was a second apply of the fragment in the step: KeyError, 2026-11-27)
        awaited = {p for p, _ in send} if self._overlap() == 0 else set()
        arrivals = inbox.take(lambda a: a.fragment not in awaited and self.fragments[a.fragment].may_take(self.step))
        # a restarted synchronizer waits for a fragment that no rank holds whole: gathered (after
        # this step's applies) and offered by the leader's next heartbeat, once per recovery; not
        # one this step applies to (its version is the one after the apply) or sends for
        changing = awaited | {a.fragment for a in arrivals}
        candidates = {f.number: f.version for f in self.fragments
                      if f.number not in changing and self.shards.any_sharded(f.number) and f.may_give_back()}
        gather = leader.to_gather(candidates)
        return StepPlan(schedule_step=self.schedule_step, fail=fail, send=send,
                        apply=[self.fragments[a.fragment].take(a, self._residuals) for a in arrivals],
                        gather=[] if gather is None else [gather])

    def _give_up_failed_flights(self, leader: LeaderSync) -> list[int]:
        """End the flights whose push was refused or unreachable (at their apply step), or that waited too long."""
        now, out = self.clock.now(), []
        for f in self.fragments:
            flight = f.flight
            if flight is None:
                continue
            refusal = flight.failure() if self.step >= flight.apply_at else None
            if refusal is not None or now - flight.sent_at > self.push_wait:
                why = refusal if refusal is not None else f"no version of round {flight.round} within {self.push_wait:.0f}s"
                log.warning("island %d: sync of fragment %d failed: %s", self.island, f.number, why)
                if refusal is not None:
                    leader.answered(False)
                self._count("failed")
                f.flight = None
                out.append(f.number)
        return out

    def _await_rounds(self, inbox: Inbox, fragments: list[int]) -> list[Apply]:
        """Synchronous DiLoCo (overlap 0): wait for the version of each round just sent for. A
        send acked late is not waited for (as at the end of the run): it waits in a round that
        opens only when some island sends for it on time, and the islands that would were
        blocked, or done; the main job at tau 0 had one island wait out push_wait (120 s) at
        every due fragment while the others finished. Its version is applied when it comes."""
        inbox.wait(lambda: not any(self.fragments[p].awaited(inbox) for p in fragments), self.push_wait)
        arrivals = inbox.take(lambda a: a.fragment in fragments and self.fragments[a.fragment].ended_by(a))
        return [self.fragments[a.fragment].take(a, self._residuals) for a in arrivals]

    def settled(self, p: int) -> bool:
        """(Leader, under the inbox's lock) fragment p's send is answered: the version of its
        round arrived, or its push failed."""
        leader = self._started_leader()
        return leader is not None and self.fragments[p].settled(leader[1])

    @contextmanager
    def global_weights(self) -> Iterator[None]:
        """The last applied global fragments in place of the local weights, put back on exit."""
        saved = self.shards.save()
        try:
            for p, f in enumerate(self.fragments):
                self.shards.write(p, f.base)
            yield
        finally:
            self.shards.restore(saved)

    # ---- the end ------------------------------------------------------------------------------

    def finish(self, timeout: float | None = None) -> bool:
        """Wait for the rounds still in flight, then load the current global model on every rank.

        Waits at most ``timeout`` seconds (default :meth:`final_wait`: a few step times); a
        contribution whose round has not closed by then is counted as ``unmerged`` and said in the
        log. The global model replaces the local weights only if it holds this island's work (one
        of its contributions was merged); otherwise the local weights stay and a warning says why
        (end_of_run.py). Returns whether the global model was loaded.
        """
        plan = None
        leader = self._started_leader()
        if leader is not None:
            plan, self.merged_any, unmerged = end_of_run(
                leader[0].link, self.island, fragments=self.fragments, inbox=leader[1], progress=self._progress(),
                timeout=self.final_wait() if timeout is None else timeout, merged_any=self.merged_any)
            self._count("unmerged", unmerged)
        for f in self.fragments:
            f.flight = None
        plan = self._share(plan)
        if plan is None:
            return False
        for p, version in plan.items():
            f = self.fragments[p]
            f.base, f.version = self.shards.scatter(p, f.base if self.is_leader else None), version
            self.shards.write(p, f.base)
        return True

    def final_wait(self) -> float:
        """Seconds the end waits for its last rounds (end_of_run.py)."""
        return final_wait(self.config.schedule.overlap_steps, self._step_time, self.push_wait)

    def stop(self) -> None:
        """Stop waiting for rounds: the island is stopping (SIGTERM). A wait in progress (for the
        rounds of a synchronous send, or the last ones at the end) returns at once, and every
        later one too, so the process ends within a step instead of a push wait. Safe in a
        signal handler (:meth:`~lightning_diloco.learner.inbox.Inbox.stop`)."""
        if self.inbox is not None:
            self.inbox.stop()

    def close(self) -> None:
        """Leave the run (the leader tells the synchronizer) and release the link."""
        if self.leader is not None:
            self.leader.close()

    # ---- state and metrics --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Outer state for Lightning checkpoints: plain tensors and numbers (weights_only-safe)."""
        return {
            "format": STATE_FORMAT,
            "layout_hash": self.layout.hash,
            "step": self.step,
            "schedule_step": self.schedule_step,
            "seq": self.seq,
            "counters": dict(self.counters),  # diloco/syncs_* go on from where they were
            **fragments_state_dict(self.fragments),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != STATE_FORMAT or state.get("layout_hash") != self.layout.hash:
            raise ValueError(
                f"the checkpoint's DiLoCo state (format {state.get('format')}, layout {state.get('layout_hash')}) does not "
                f"match this model (format {STATE_FORMAT}, layout {self.layout.hash}); resume with the same model and "
                "num_fragments"
            )
        self.step = int(state["step"])
        self.schedule_step = int(state["schedule_step"])
        load_fragments(self.fragments, state)
        self.seq = max(self.seq, int(state["seq"]))
        saved = state.get("counters", {})  # absent from checkpoints written before they were saved
        with self._lock:
            self.counters = {name: int(saved.get(name, 0)) for name in COUNTERS}

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out = {f"diloco/syncs_{k}": float(v) for k, v in self.counters.items()}
        late, bytes_up = (self.leader.late, self.leader.bytes_up) if self.leader else (0, 0)
        out.update({
            "diloco/syncs_late": float(late),
            "diloco/bytes_up": float(bytes_up),
            "diloco/bytes_down": float(self.inbox.bytes_received if self.inbox else 0),
            "diloco/blocked_s": self.blocked_s,
            "diloco/network_wait_s": self.network_wait_s,
            "diloco/staleness": float(self.staleness),
            "diloco/in_flight": float(len(self.in_flight)),
            "diloco/min_version": float(min(self.versions)),
            "diloco/schedule_step": float(self.schedule_step),
            "diloco/synchronizer_reachable": float(self.reachable),
        })
        return out
