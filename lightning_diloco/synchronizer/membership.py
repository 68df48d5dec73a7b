"""Who is in the run: joined islands, their liveness, step times and place on the run's clock.

The run's clock is the lower median of the schedule steps the live islands reported (with every
contribution and every heartbeat): a place at least half of them have reached, so no one island
can move it, however far ahead it claims to be (one island reporting 2**62 used to
carry the clock, and make every honest push late). Islands stay in phase because one that falls
behind is asked for each round as it opens and skips to it (its requests wait here until its
subscription picks them up), so the median sits within a round of the fastest. The clock is not
extrapolated between reports: an island that was just killed or paused still looks live for a
while. An island joining or rejoining starts at the clock.

An island that ends its run, or is stopped, says so (:meth:`Membership.leave`, the Leave call):
it is no longer live from then on, not after the liveness timeout, so rounds stop waiting for it
and the clock no longer counts its place; the quorum a round needs counts it as gone
(core/quorum.py). Only its current session may leave, so no client can make another island
leave. A left island is remembered as left (Status says so) until it joins again, which it may
as any island: its later calls from the old session are answered as from an island not joined.

One process per island: a join as an island whose session was heard from within the last
``running_window`` seconds is refused (:class:`IslandRunning`) unless it comes from the client
that holds that session (it presents it: a rejoin after the synchronizer forgot it, or after the
shard was away). A remote join that presents none is a new process, checked like any other (one
taken for an older client's and let through took a live island's slot, and its heartbeats kept
the island's own rejoin refused: 0 of 60 sends applied). Two processes started with one index used to take the session from each other
on every call (``wrong_session`` both ways) and both trained as the same island. A crashed
island's restart is let in once its old session has been silent that long.

An island's own reported place is bounded too: it may lead the clock by ``lead_steps`` (one
round, H) and beyond that advance no faster than the live islands' step rate allows
(``RATE_SLACK`` x the lower median of their step times), so a report of 2**62 moves it a few
steps, not to 2**62.

A round request ("send this fragment now") reaches an island only once the round is due on the
run's clock (:meth:`Membership.take_requests`): a round one island opened ahead of the others
waits for the others to reach it on their own. Islands realign only to requests, so no island
can carry the others' places, and with them the clock, past their own steps: the clock is a place
at least half the islands reached by stepping (one of two: the lower one), and an island behind
it is only ever asked to catch up to it. (With requests handed out as soon as a round opened, one
island that sent for the round a lead ahead after every close moved every honest island, and so
the clock, a lead ahead each time: 2,336-4,660 steps of clock for about 350 inner steps.)
Step times are a lower median as well: one island reporting 1e9 s cannot stretch the grace
window, and one reporting 1e-9 s only shortens it (rounds then close at quorum, no stall).

All methods take ``now`` (monotonic seconds) from the caller.
"""

from __future__ import annotations

import math
import threading
import uuid
from dataclasses import dataclass, field

from lightning_diloco.core.guard import lower_median
from lightning_diloco.core.protocol import RUNNING_WINDOW, IslandStatus, RoundRequest

MAX_ISLANDS = 10_000
MAX_STEP_TIME = 3600.0  # seconds: a reported step time beyond this is not a step time
MAX_STEPS_PER_SECOND = 1000  # how fast an island's reported place on the clock may advance, at most
RATE_SLACK = 2.0  # x the run's step rate: how much faster than the typical island one may advance
LIVENESS_TIMEOUT = 15.0  # default seconds of silence after which an island is not waited for
FORGET_AFTER = 600.0  # seconds of silence after which an island leaves Status (it may rejoin)


class SessionError(LookupError):
    """A call from a client whose session is not (or no longer) the island's current one."""


class IslandRunning(LookupError):
    """A join as an island whose current session, another client's, is still heard from."""

    def __init__(self, island: int, silent: float, window: float) -> None:
        super().__init__(island)
        self.island, self.silent, self.window = island, silent, window


@dataclass
class Member:
    world_size: int
    last_seen: float
    session: str = ""
    """Issued at join; every later call must carry it. A rejoin issues a new one."""
    subscription: int = 0
    """Which subscription is current: a newer one ends the older."""
    steps: int = 0
    """Inner steps the island reported."""
    schedule_step: int = 0
    """The furthest place on the run's clock it reported (bounded: see the module's text)."""
    placed_at: float = 0.0
    """When ``schedule_step`` was last considered: its advance is bounded by the time since."""
    step_time: float = 0.0
    accepted: int = 0
    """Contributions merged in this synchronizer's lifetime."""
    merged_at: float | None = None
    """When its last contribution was merged (None: never, in this synchronizer's lifetime)."""
    requests: dict[int, RoundRequest] = field(default_factory=dict)
    """Rounds the island is asked to send for, by fragment (only the newest per fragment)."""
    left: bool = False
    """It left the run (:meth:`Membership.leave`) and has not joined since."""


class Membership:
    def __init__(self, liveness_timeout: float, lead_steps: int = 0) -> None:
        """``lead_steps``: how far ahead of the run's clock an island's report may be (one H)."""
        self.liveness_timeout, self.lead_steps = liveness_timeout, lead_steps
        self.running_window = min(RUNNING_WINDOW, liveness_timeout)  # an island no longer live is not running
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # a request or a new version for subscribers
        self.members: dict[int, Member] = {}

    def join(self, island: int, world_size: int, now: float, at_step: int = 0, previous_session: str | None = None) -> str:
        """Register (or re-register) an island starting at schedule step ``at_step`` (the run's
        step it is told); returns its new session. The old one ends.

        ``previous_session``: the session the joining client last had ("": none, a new process,
        or a remote join that did not say); None: an in-process caller, not checked.
        IslandRunning when another client's session of the island is still heard from."""
        with self.lock:
            self._forget_silent(now)
            old = self.members.get(island)
            self._check_not_running(old, island, now, previous_session)
            if old is None and len(self.members) >= MAX_ISLANDS:
                raise OverflowError(f"the run already has {MAX_ISLANDS} islands; island ids must be reused, not invented")
            session = uuid.uuid4().hex
            self.members[island] = Member(world_size=world_size, last_seen=now, session=session,
                                          schedule_step=max(at_step, old.schedule_step if old else 0), placed_at=now,
                                          accepted=old.accepted if old else 0,
                                          subscription=old.subscription + 1 if old else 0)
            self.changed.notify_all()  # ends the old session's subscription
            return session

    def _check_not_running(self, old: Member | None, island: int, now: float, previous_session: str | None) -> None:
        if previous_session is None or old is None or old.left or previous_session == old.session:
            return  # not checked, the island's first join, one that left, or the holder of its session joining again
        silent = now - old.last_seen
        if silent <= self.running_window:
            raise IslandRunning(island, silent, self.running_window)

    def _forget_silent(self, now: float) -> None:
        # a left island is kept: forgotten, it would count as still in the run, and a round of a
        # quorum it lowered would wait for it again (core/quorum.py)
        forget = max(FORGET_AFTER, 10 * self.liveness_timeout)
        for i in [i for i, m in self.members.items() if not m.left and now - m.last_seen > forget]:
            del self.members[i]

    def check(self, island: int, session: str | None) -> None:
        """Raise KeyError for an island that never joined (or left), SessionError for a stale
        session. ``session`` None: an in-process caller, trusted."""
        with self.lock:
            self._member(island, session)

    def _member(self, island: int, session: str | None) -> Member:
        """(With ``lock`` held.) The island's record, checked as :meth:`check` says."""
        m = self.members.get(island)
        if m is None or m.left:
            raise KeyError(island)
        if session is not None and session != m.session:
            raise SessionError(island)
        return m

    def leave(self, island: int, session: str | None) -> None:
        """The island leaves the run: no longer live nor on the clock, counted in :meth:`left_count`,
        its requests dropped and its subscription ended. Raises as :meth:`check`, changing
        nothing: only the island's current session may leave."""
        with self.lock:
            m = self._member(island, session)
            m.left = True
            m.requests.clear()
            self.changed.notify_all()  # ends its subscription; requests held for the clock may be due now

    def left_islands(self) -> list[int]:
        """The islands that left the run and have not joined since (a checkpoint keeps them)."""
        with self.lock:
            return sorted(i for i, m in self.members.items() if m.left)

    def restore_left(self, islands: list[int], now: float) -> None:
        """Remember ``islands`` as left, from a checkpoint: a restarted synchronizer that forgot
        them counted them in the run again, and a round of a quorum they had lowered waited for them."""
        with self.lock:
            for island in islands:
                if island not in self.members and len(self.members) < MAX_ISLANDS:
                    self.members[island] = Member(world_size=1, last_seen=now, placed_at=now, left=True)

    def left_count(self) -> int:
        """How many islands left the run and have not joined since."""
        with self.lock:
            return sum(m.left for m in self.members.values())

    def seen(self, island: int, now: float, *, steps: int | None = None, schedule_step: int | None = None,
             step_time: float | None = None) -> bool:
        """Record a sign of life, values clamped to what a real island can report; False when the
        island never joined."""
        with self.lock:
            m = self.members.get(island)
            if m is None or m.left:  # a call admitted just before its island left does not bring it back
                return False
            if steps is not None:
                m.steps = max(0, min(int(steps), 10**12))
            if step_time is not None and math.isfinite(step_time) and step_time > 0:
                m.step_time = min(float(step_time), MAX_STEP_TIME)
            if schedule_step is not None:  # a retried old push must not move an island back
                live = self._live(now)
                clock = self._clock(live)
                ceiling = max(clock + self.lead_steps,
                              m.schedule_step + int(max(0.0, now - m.placed_at) * self._max_rate(live)))
                m.schedule_step = max(m.schedule_step, min(int(schedule_step), ceiling))
                m.placed_at = now
                if self._clock(live) != clock and any(other.requests for other in self.members.values()):
                    self.changed.notify_all()  # requests held for the clock may be due now
            m.last_seen = now
            return True

    def live(self, now: float) -> set[int]:
        with self.lock:
            return self._live(now)

    def _live(self, now: float) -> set[int]:
        return {i for i, m in self.members.items() if not m.left and now - m.last_seen <= self.liveness_timeout}

    def step_time(self, live: set[int]) -> float:
        """The lower median inner-step time of the live islands (0 when none reported one)."""
        with self.lock:
            return self._step_time(live)

    def _step_time(self, live: set[int]) -> float:
        times = [self.members[i].step_time for i in live if i in self.members and self.members[i].step_time > 0]
        median = lower_median(times)  # None: no finite time among them
        return 0.0 if median is None else median

    def _max_rate(self, live: set[int]) -> float:
        """Steps per second an island's place may advance by (beyond its lead on the clock)."""
        step_time = self._step_time(live)
        return MAX_STEPS_PER_SECOND if step_time <= 0 else min(MAX_STEPS_PER_SECOND, RATE_SLACK / step_time)

    def _clock(self, live: set[int]) -> int:
        median = lower_median([self.members[i].schedule_step for i in live if i in self.members])
        return 0 if median is None else median

    def run_step(self, now: float) -> int | None:
        """The run's clock: the lower median of the live islands' schedule steps (None: none live)."""
        with self.lock:
            live = self._live(now)
            return self._clock(live) if live else None

    def reach(self, island: int, now: float) -> int:
        """The furthest place the island may have reached by ``now`` at the rate bound (its place
        lags its steps by up to a heartbeat; 0: not joined)."""
        with self.lock:
            m = self.members.get(island)
            if m is None:
                return 0
            return m.schedule_step + int(max(0.0, now - m.placed_at) * self._max_rate(self._live(now)))

    def ask(self, request: RoundRequest, islands: set[int]) -> None:
        """Ask ``islands`` to send ``request.fragment`` now; wakes their subscriptions."""
        with self.lock:
            for i in islands:
                if i in self.members:
                    self.members[i].requests[request.fragment] = request
            self.changed.notify_all()

    def withdraw(self, fragment: int, round_index: int) -> None:
        """A round closed: requests for it (or earlier) are moot. Wakes subscriptions."""
        with self.lock:
            for m in self.members.values():
                r = m.requests.get(fragment)
                if r is not None and r.round <= round_index:
                    del m.requests[fragment]
            self.changed.notify_all()

    def wake(self) -> None:
        """Wake every subscription where it waits for news: each looks again at whether it should
        go on (a seed, a shutdown, a reader told to stop)."""
        with self.lock:
            self.changed.notify_all()

    def subscribed(self, island: int) -> int:
        """Make a new subscription of ``island`` the current one; returns its number."""
        with self.lock:
            m = self.members[island]
            m.subscription += 1
            self.changed.notify_all()
            return m.subscription

    def is_current(self, island: int, subscription: int) -> bool:
        """(With ``lock`` held.)"""
        m = self.members.get(island)
        return m is not None and not m.left and m.subscription == subscription

    def take_requests(self, island: int, now: float) -> list[RoundRequest]:
        """Pending requests of one island that are due on the run's clock, removed (the others
        wait: the module's text says why). Call with ``lock`` held."""
        m = self.members.get(island)
        if m is None or not m.requests:
            return []
        clock = self._clock(self._live(now))
        out = [r for r in m.requests.values() if r.due_step <= clock]
        for r in out:
            del m.requests[r.fragment]
        return out

    def credit(self, islands: tuple[int, ...], now: float) -> None:
        with self.lock:
            for i in islands:
                if i in self.members:
                    self.members[i].accepted += 1
                    self.members[i].merged_at = now

    def status(self, now: float) -> dict[int, IslandStatus]:
        live = self.live(now)
        with self.lock:
            return {
                i: IslandStatus(
                    live=i in live, world_size=m.world_size, steps=m.steps, schedule_step=m.schedule_step,
                    step_time_s=m.step_time, accepted=m.accepted, seen_s_ago=now - m.last_seen,
                    merged_s_ago=None if m.merged_at is None else now - m.merged_at, left=m.left,
                )
                for i, m in sorted(self.members.items())
            }
