"""The synchronizer: validates requests and routes each to the fragment it is for.

Transport-agnostic: the gRPC server and in-process callers drive the same object.

- The run: its settings, layout, island count and owned fragments (run.py), its membership and
  clock (membership.py), its checkpoints (durability.py) and Status; how this synchronizer runs
  (shard, checkpoints, pins, clock): settings.py.
- Each owned fragment is one :class:`~lightning_diloco.synchronizer.fragment.Fragment`
  (fragment.py), which owns its state, rounds, lock, recovery after a restart and what it takes
  in. A seed, a push or a pull is checked here for what every request of an island passes (the
  fragment is one of this shard's and the run has a layout, the caller's session) and handed to
  its fragment: a push is one call, :meth:`push` (every rule it can be refused by, in order:
  push_admission.py). Its closer thread (closers.py) closes its rounds; tests move a fake clock
  and call :meth:`poll` instead.
- Every new version reaches every subscribed island (:meth:`subscribe`), contributor or not, as a
  delta against the version that island last received.

Every refusal is a :class:`~lightning_diloco.synchronizer.requests.Refusal` with a
:class:`~lightning_diloco.reasons.Reason` that :attr:`Synchronizer.tally` counts (requests.py).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from lightning_diloco.core.codecs import EXACT, Payload
from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.fragments import FragmentLayout, TensorSpec
from lightning_diloco.core.protocol import Beat, Contribution, JoinInfo, PushAck, RoundRequest, SynchronizerStatus, VersionUpdate
from lightning_diloco.core.state import SynchronizerState
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.admission import join_problem, running_message
from lightning_diloco.synchronizer.delivery import island_events
from lightning_diloco.synchronizer.durability import CheckpointDirectory, Checkpointer
from lightning_diloco.synchronizer.fragment import Shared
from lightning_diloco.synchronizer.membership import IslandRunning, Membership, SessionError
from lightning_diloco.synchronizer.requests import Tally
from lightning_diloco.synchronizer.rounds import ClosedRound
from lightning_diloco.synchronizer.run import Run
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.synchronizer.version_log import RECOVERY_SETTLE

log = logging.getLogger(__name__)


class Synchronizer:
    def __init__(self, config: RunConfig, settings: SynchronizerSettings | None = None, *,
                 state: SynchronizerState | None = None) -> None:
        """``settings``: how this synchronizer runs (settings.py; None: the defaults, an embedded
        one's). ``state``: start from this state (e.g. restored from an island's checkpoint)
        unless the checkpoint directory holds one. Call :meth:`start` to run the closers."""
        settings = settings or SynchronizerSettings()
        self.shard, self.num_shards, self.clock = settings.shard, settings.num_shards, settings.clock
        self.incarnation = uuid.uuid4().hex[:12]  # per-process counters (accepted, refused) restart with it
        self.membership = Membership(settings.liveness_timeout, lead_steps=config.schedule.sync_every)
        self.closing = threading.Event()  # set on shutdown: waiting calls return at once
        self.tally = Tally()
        # this synchronizer's until shutdown: a second shard on it is refused here
        self.directory = directory = CheckpointDirectory(settings, state)
        wait = settings.recovery_wait
        recovery_deadline, recovery_settled_at = self.clock() + wait, self.clock() + min(RECOVERY_SETTLE, wait)
        if directory.loaded is not None:
            state = directory.loaded
            self.membership.restore_left(state.left, self.clock())
        due = threading.Event()  # set after each close: the checkpointer writes one if it is due
        self.shared = Shared(self.membership, self.tally, self.clock, directory.versions, due,
                             recovery_settled_at=recovery_settled_at, recovery_deadline=recovery_deadline, recovery_wait=wait)
        self.run = Run(config, state, settings, num_islands=directory.num_islands, shared=self.shared, logged=directory.logged,
                       closing=self.closing)
        self.checkpointer = Checkpointer(directory.path, settings.checkpoint_every, snapshot=lambda: self.run.snapshot(directory.identity),
                                         outer_steps=lambda: self.run.state.outer_steps if self.run.state else 0,
                                         closing=self.closing, due=due, versions=directory.versions)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Synchronizer:
        """Run one closer thread per owned fragment, now or once the first island has joined."""
        self.run.start()
        self.checkpointer.start()
        return self

    def shutdown(self, *, keep_checkpoint_dir: bool = False) -> None:
        """Stop the closers and release every call waiting on a round, a pull or a subscription;
        then the checkpoint directory, unless ``keep_checkpoint_dir`` (a final checkpoint is to
        be written: then ``directory.release()`` after it, durability.py)."""
        self.closing.set()
        self.run.wake()
        self.membership.wake()
        self.checkpointer.stop()
        self.run.closers.stop()
        if not keep_checkpoint_dir:
            self.directory.release()

    # ---- membership -----------------------------------------------------------------------

    def join(self, island: int, world_size: int, specs: Sequence[TensorSpec], *, num_islands: int = 0,
             previous_session: str | None = None) -> JoinInfo:
        """Register an island; returns the run settings, layout hash, versions, run step and session.

        ``num_islands``: the run's island count as the island was started with (0: not said);
        once the operator or a quorum of the islands fixed the run's (admission.py), another is
        refused naming both; before that, none is. The layout: the run's, or adopted (run.py).
        ``previous_session``: the session this client last had with this synchronizer ("": none,
        also what a remote join that leaves it out is taken as); None: an in-process caller (the
        embedded synchronizer's own island), not checked. A join as an island another client is
        running as is refused (membership.py)."""
        problem = join_problem(island, world_size, num_islands)
        if problem:
            raise self.tally.refuse(Reason.BAD_ISLAND, problem)
        layout = self.run.adopt(island, specs, num_islands)
        now = self.clock()
        run_step = self.run.run_step(now)
        try:
            session = self.membership.join(island, world_size, now, at_step=run_step, previous_session=previous_session)
        except OverflowError as err:
            raise self.tally.refuse(Reason.TOO_MANY_ISLANDS, str(err)) from None
        except IslandRunning as running:
            raise self.tally.refuse(Reason.ISLAND_RUNNING, running_message(running)) from None
        if num_islands:
            self.run.count_stated(island, num_islands)
        return JoinInfo(config=self.run.config, layout_hash=layout.hash, versions=self.versions(), run_step=run_step,
                        session=session, incarnation=self.incarnation)

    def _check_session(self, island: int, session: str | None, what: str,
                       check: Callable[[int, str | None], None] | None = None) -> None:
        """``check`` (membership's :meth:`~Membership.check` unless given) raises as it does."""
        try:
            (check or self.membership.check)(island, session)
        except SessionError:
            raise self.tally.refuse(Reason.WRONG_SESSION, f"island {island} joined again since this client's session began, "
                                    f"so its {what} is refused; a client rejoins to get the current session") from None
        except KeyError:
            raise self.tally.refuse(Reason.NOT_JOINED, f"island {island} sent a {what} before joining; call Join first") from None

    def heartbeat(self, island: int, steps: int, step_time: float, schedule_step: int | None = None,
                  session: str | None = None) -> Beat:
        """Record an island's progress (clamped to plausible values); returns every owned
        fragment's version and the run step."""
        now = self.clock()
        self._check_session(island, session, "heartbeat")
        self.membership.seen(island, now, steps=steps, schedule_step=schedule_step, step_time=step_time)
        self.run.wake()  # liveness may have changed what a round waits for
        return Beat(versions=self.versions(), run_step=self.run.run_step(now))

    def leave(self, island: int, session: str | None = None) -> None:
        """The island ends its part in the run (its training ended, or it was stopped): from now
        on no round waits for it, the run's clock no longer counts it, and a round needs at most
        the islands still in the run (core/quorum.py). Only from its current session (refused as
        any call of another: wrong_session, not_joined), so no client can make another island
        leave. Its entries already in rounds stay; a later call from it is answered as from an
        island not joined, so it may join again as any island."""
        self._check_session(island, session, "leave", check=self.membership.leave)
        log.info("island %d left the run", island)
        self.run.wake()  # a round short of the quorum, or waiting for this island, may close now

    def live_islands(self, now: float | None = None) -> set[int]:
        return self.membership.live(self.clock() if now is None else now)

    def versions(self) -> dict[int, int]:
        """Fragment versions this shard owns; -1 for a fragment not seeded yet."""
        self.run.fall_back_if_overdue()
        owned = [p for p in range(self.run.config.schedule.num_fragments) if self.run.owned(p)]
        return {p: self.run.fragments[p].version() if p in self.run.fragments else -1 for p in owned}

    # ---- seeds, pushes and pulls: checked here, taken by their fragment (fragment.py) -------------

    def admit_seed(self, island: int, fragment: int, session: str | None) -> tuple[int | None, int]:
        """A seed's header checks, before its payload is read: the fragment's version when it is
        seeded already (the first offer won: the server answers so without reading the payload,
        where 200 held seeds of a seeded fragment were each read in full, 1.7 GB, to be ignored),
        else None; and the bytes its payload must have (fp32)."""
        owned = self.run.fragment(fragment)
        self._check_session(island, session, "seed")
        version = owned.version()
        return (version if version >= 0 else None), owned.payload_bytes(EXACT)

    def seed(self, island: int, fragment: int, payload: Payload, session: str | None = None) -> bool:
        """Offer version 0 of a fragment (fp32). The first offer wins; later ones are ignored.
        For a fragment recovering after a restart, the offer of the version the log holds: taken
        if its bytes have the logged digest, ignored (False) if not."""
        owned = self.run.fragment(fragment)
        self._check_session(island, session, "seed")
        return owned.seed(island, payload, self.run.num_islands)

    def push(self, c: Contribution, *, declared_bytes: int | None = None,
             receive: Callable[[int], Payload] | None = None) -> PushAck:
        """Put a contribution into its fragment's round; answered at once, merged when it closes.
        A retry with the same sequence number gets the same answer and is never merged twice.

        One call per push, one admission: the header is admitted (push_admission.py) before its
        payload is looked at. ``receive(expected_bytes)``: the payload, asked for only once the
        header is admitted (the server reads it from its stream then, so a stream from no session,
        or for no fragment, holds no worker while its bytes trickle in); None: ``c.payload`` is
        it. ``declared_bytes``: the payload size a stream's header declares, checked first."""
        fragment = self.run.fragment(c.fragment)  # steps 1-2
        self._check_session(c.island, c.session, "push")  # step 3
        expected = fragment.admit(c, declared_bytes)  # steps 4-8
        payload = c.payload if receive is None else receive(expected)
        return fragment.push(c, payload)  # steps 9-12

    def admit_pull(self, island: int, fragment: int, session: str | None) -> None:
        """A pull's checks: a fragment of this shard, for a joined island's session. A pull copies
        its fragment, so only a member may ask (unjoined pulls never read held 1 GB per 300)."""
        self.run.fragment(fragment)
        self._check_session(island, session, "pull")

    def pull(self, fragment: int, island: int | None = None) -> tuple[int, torch.Tensor]:
        """(version, fp32 copy) of a fragment as the islands hold it (with a lossy downlink the
        published value, core/downlink.py, so the next version's delta lands on it): what a
        joining island starts from (new versions reach it through its subscription).

        A fragment recovering after a restart is refused (``not_seeded``), unless ``island`` offered
        what it holds and that was not the last version: it has nothing to give back, so its pull
        waits for the recovery to end (run.py ``await_recovery``) and is served then."""
        owned = self.run.fragment(fragment)
        if island is not None:
            self.run.await_recovery(owned, island)
        return owned.pull()

    # ---- the operator's export -----------------------------------------------------------

    def export_layout(self) -> tuple[FragmentLayout, dict[int, int]]:
        """The run's layout and this shard's versions, for the operator's export (server.py)."""
        state = self.run.state
        if state is None:
            raise self.tally.refuse(Reason.NOT_JOINED, "no island has joined this synchronizer yet: the run has no model to "
                                    "export; export once its islands have started")
        return state.layout, self.versions()

    def export(self, fragment: int) -> tuple[int, torch.Tensor]:
        """(version, fp32 copy) of a fragment's exact global value, the one its outer steps move
        (a pull gets what the islands hold, which a lossy downlink makes an approximation of it).
        Reads only: no island's membership, round or counter changes."""
        return self.run.fragment(fragment).export()

    # ---- closing rounds ------------------------------------------------------------------------

    def poll(self, now: float | None = None) -> list[ClosedRound]:
        """Close every round that is due to close at ``now``: what the closers do, for tests (a
        checkpoint that is due is written here, on the caller's thread)."""
        closed = self.run.closers.poll(self.clock() if now is None else now)
        if closed:  # outside the fragments' locks: a checkpoint takes each of them in turn
            self.checkpointer.write_if_due()
        return closed

    # ---- subscriptions ---------------------------------------------------------------------

    def subscribe(self, island: int, versions: dict[int, int], active: Callable[[], bool] = lambda: True,
                  tick: float = 0.5, session: str | None = None) -> Iterator[RoundRequest | VersionUpdate]:
        """Requests and new versions for one island, until ``active()`` turns False, the island
        subscribes again or rejoins (one subscription per island), or shutdown.

        ``versions``: the version of each fragment the island holds; updates are deltas against
        it (a full value for a version this synchronizer no longer keeps, or newer than its own).
        Refuses at once, before the first event, an island that has not joined.
        """
        self._check_session(island, session, "subscription")
        delivered = {p: int(versions.get(p, -1)) for p in self.run.fragments}
        return island_events(island, self.membership.subscribed(island), delivered, self.run.fragments, self.shared,
                             lambda: active() and not self.closing.is_set(), tick)

    def wake_subscriptions(self) -> None:
        """Wake every subscription where it waits for news, so that one whose ``active()`` turned
        False ends now rather than at its next tick (an in-process reader told to stop)."""
        self.membership.wake()

    # ---- durability and status ----------------------------------------------------------------

    def checkpoint(self) -> Path | None:
        """Write a checkpoint now (no-op without a directory or a state)."""
        return self.checkpointer.write()

    def snapshot(self) -> SynchronizerState:
        """A consistent copy of the state, fragment by fragment (run.py), once an island has joined."""
        snapshot = self.run.snapshot(self.directory.identity)
        assert snapshot is not None, "no island has joined: nothing to snapshot"
        return snapshot

    def status(self) -> SynchronizerStatus:
        now = self.clock()
        live, islands = self.live_islands(now), self.membership.status(now)
        versions, run_step = self.versions(), self.run.run_step(now)
        rounds = {p: fragment.round_status() for p, fragment in self.run.fragments.items()}
        state, config, tally = self.run.state, self.run.config, self.tally
        with tally.lock:
            return SynchronizerStatus(
                shard=self.shard, num_shards=self.num_shards, incarnation=self.incarnation,
                layout_hash=state.layout.hash if state else "", outer_steps=self.run.outer_steps(),
                run_step=run_step, sync_every=config.schedule.sync_every, num_fragments=config.schedule.num_fragments,
                min_quorum=config.merge.min_quorum, bytes_in=tally.bytes_in, bytes_out=tally.bytes_out,
                checkpoint_failures=self.checkpointer.failures, last_checkpoint_error=self.checkpointer.last_error,
                last_checkpoint_outer_steps=self.checkpointer.last_steps, versions=versions,
                live_islands=sorted(live), islands=islands, rounds=rounds, accepted=dict(tally.accepted),
                refused=dict(tally.refused), adjustments=list(self.run.adjustments),
            )
