"""One fragment of the run on the synchronizer, and its one owner: :class:`Fragment`.

A fragment's lock, its state (core/state.py ``FragmentState``), its rounds (rounds.py), the seeds
and pushes it takes in, what a closed round changes beyond it, and its recovery after a restart
are all here. The service (service.py) checks what every request of an island passes (the
fragment is one of this shard's, the caller's session) and calls the fragment; nothing here calls
back into the service. A push: ``Synchronizer.push`` → :meth:`Fragment.admit` (its header) → the
payload received → :meth:`Fragment.push` (into its round); its closer (closers.py) →
:meth:`Fragment.close` (the outer step, which publishes the new version, then what the close
changes beyond the fragment). Every rule a push is refused by, in order: push_admission.py.

After a restart a fragment whose logged version is newer than its checkpoint's is *recovering*
(version_log.py): it is served to no one until an island gives that version back (a seed whose
bytes have its digest: :meth:`Fragment.seed`), or the restart settles on an older one, or the
recovery wait ends (:meth:`Fragment.fall_back_if_overdue`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lightning_diloco.core.codecs import EXACT, NonFiniteError, Payload, get_codec, payload_size
from lightning_diloco.core.config import CODECS, RunConfig
from lightning_diloco.core.fragments import TensorSpec
from lightning_diloco.core.merge import norm64
from lightning_diloco.core.outer import outer_gradient
from lightning_diloco.core.protocol import Contribution, PushAck, RoundRequest, RoundStatus, VersionUpdate
from lightning_diloco.core.schedule import due_step, latest_round
from lightning_diloco.core.state import FragmentState, SynchronizerState
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.admission import seed_problem
from lightning_diloco.synchronizer.membership import Membership
from lightning_diloco.synchronizer.push_admission import admitted_round, contribution_problem, declared_size_problem
from lightning_diloco.synchronizer.requests import Tally, payload_digest
from lightning_diloco.synchronizer.rounds import ClosedRound, Entry, FragmentRounds, RoundFull, SequenceError, each_part
from lightning_diloco.synchronizer.version_log import VersionLog, value_digest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shared:
    """What the fragments of one synchronizer share."""

    membership: Membership
    tally: Tally
    clock: Callable[[], float]
    versions: VersionLog | None  # a new version is logged before it is seen (None: no checkpoint directory)
    checkpoint_due: threading.Event  # set after each close: the checkpointer writes one if it is due
    recovery_settled_at: float  # clock time after which a recovering fragment takes the newest older version offered
    recovery_deadline: float  # clock time after which one no island gave back is served its checkpoint's version
    recovery_wait: float  # seconds of that wait (--recovery-wait), for the log


class Fragment:
    """Fragment ``number`` of the run on this synchronizer. ``cond`` is its lock (a condition:
    its closer and recovering pulls wait on it); ``state``, ``rounds`` and the recovery fields
    are read and written with it held. Lock order: ``cond`` before the membership's lock and the
    tally's, never after them.

    ``run_state``: the run's state, where the fragment's state is registered for checkpoints and
    Status (and, from a checkpoint, found); ``logged``: the fragment's (version, digest)s in the
    version log, from which it knows whether it recovers."""

    def __init__(self, number: int, specs: Sequence[TensorSpec], offset: int, config: RunConfig,
                 run_state: SynchronizerState, shared: Shared, logged: Sequence[tuple[int, str]]) -> None:
        self.number, self.offset, self.config, self.run_state, self.shared = number, offset, config, run_state, shared
        self.numel = run_state.layout.fragment_numel(number)
        self.cond = threading.Condition()
        self.state: FragmentState | None = None
        """Set once the fragment is seeded (or, recovering, taken back): what is served."""
        self.rounds = FragmentRounds(number, specs, config)
        self.recovering: dict[int, str] | None = None
        """Version -> digest of the versions the version log holds and the checkpoint lacks: until an
        island gives one back no one is served this fragment."""
        self.offered: tuple[int, torch.Tensor] | None = None
        """While recovering: the newest of those versions offered, if not the last one (taken once
        the restart has settled, unless the last one comes)."""
        self.offered_by: set[int] = set()
        """While recovering: the islands that offered a value and did not hold the last version."""
        self.held_back: FragmentState | None = None
        """While recovering: the checkpoint's state of the fragment (None: it had none), checkpointed
        as it is and served if no island gives the version back in time."""
        frag = run_state.fragments.get(number)
        checkpointed = frag.version if frag is not None else -1
        newer = {v: digest for v, digest in logged if v > checkpointed}
        if newer:
            # islands were given versions the checkpoint lacks: they are theirs to give back
            if frag is not None:  # islands holding only the checkpoint's say so by offering it
                newer[frag.version] = value_digest(frag.published_value_view())
            self.recovering, self.held_back = newer, frag
            log.warning("fragment %d: version %d was published but the checkpoint holds %s; it is served to no one "
                        "until an island that holds it gives it back (at most %.0f s, --recovery-wait)", number,
                        max(newer), "no version" if frag is None else f"version {frag.version}", shared.recovery_wait)
        elif frag is not None:
            self._serve(frag)
        if number in run_state.memory:  # from a checkpoint
            self.rounds.restore(run_state.memory[number])

    # ---- what is served ---------------------------------------------------------------------

    def version(self) -> int:
        """The version served; -1 while unseeded or recovering. Read without the lock (one
        reference read): a heartbeat never waits for a close."""
        state = self.state
        return state.version if state is not None else -1

    def outer_steps(self) -> int:
        """Outer steps this fragment has taken: the version served, or while it recovers the version
        it waits to get back (taken before the restart: the count drops only if it is lost); 0
        unseeded. Reference reads without the lock, as :meth:`version`'s."""
        recovering, state = self.recovering, self.state
        if recovering:
            return max(recovering)
        return state.version if state is not None else 0

    def served(self) -> FragmentState:
        """(With ``cond`` held.) The state served, or a ``not_seeded`` refusal saying why there is none."""
        if self.recovering is not None:
            raise self.shared.tally.refuse(
                Reason.NOT_SEEDED, f"fragment {self.number} waits for an island to give back its version "
                f"{max(self.recovering)}, published before this synchronizer restarted; an island holding it offers it "
                "as a seed (at most --recovery-wait s, then the checkpoint's is served)")
        if self.state is None:
            raise self.shared.tally.refuse(Reason.NOT_SEEDED, f"fragment {self.number} has no value yet; seed it first")
        return self.state

    def pull(self) -> tuple[int, torch.Tensor]:
        """(version, fp32 copy) as the islands hold it (with a lossy downlink the published value)."""
        with self.cond:
            frag = self.served()
            return frag.version, frag.published_value()

    def export(self) -> tuple[int, torch.Tensor]:
        """(version, fp32 copy) of the exact global value, the one the outer steps move."""
        with self.cond:
            frag = self.served()
            return frag.version, frag.value.clone()

    def updates_for(self, island: int, have: int) -> list[VersionUpdate]:
        """What ``island``, holding version ``have``, is sent to hold the current one (rounds.py ``publish``)."""
        with self.cond:
            if self.state is None:  # not served yet: nothing to send
                return []
            return self.rounds.publish(self.state, island, have)

    def round_status(self) -> RoundStatus:
        with self.cond:
            return self.rounds.status(self.state)

    def save_into(self, snapshot: SynchronizerState) -> None:
        """Copy the fragment, as a checkpoint keeps it, into ``snapshot`` (under its lock): the state
        served, or while recovering the checkpoint's, and what its rounds remember."""
        with self.cond:
            frag = self.state if self.recovering is None else self.held_back
            if frag is not None:
                snapshot.seed(self.number, frag.value)
                snapshot.fragments[self.number].load_state_dict(frag.state_dict())
                snapshot.memory[self.number] = self.rounds.memory()

    def wake(self) -> None:
        """Its closer looks again (liveness or the quorum changed, or shutdown)."""
        with self.cond:
            self.cond.notify_all()

    # ---- payloads ---------------------------------------------------------------------------

    def payload_bytes(self, codec_name: str) -> int:
        """Bytes a payload of this fragment must have in ``codec_name`` (push admission step 7
        refuses an unknown codec)."""
        return self._codec(codec_name).encoded_size(self.numel)

    def decode(self, codec_name: str, payload: Payload) -> torch.Tensor:
        """Push admission step 9 (a seed's too, in EXACT): the payload's values, or a refusal naming what is wrong."""
        codec = self._codec(codec_name)
        try:
            return codec.decode(payload, self.numel)
        except ValueError as err:
            reason = Reason.NON_FINITE if isinstance(err, NonFiniteError) else Reason.BAD_PAYLOAD
            raise self.shared.tally.refuse(reason, str(err)) from None

    def _codec(self, codec_name: str):
        if codec_name not in CODECS:
            raise self.shared.tally.refuse(Reason.UNKNOWN_CODEC, f"codec {codec_name[:40]!r} is not one of {', '.join(CODECS)}")
        return get_codec(codec_name, self.config.codec.block_size, self.config.codec.sparse_density)

    # ---- seeds and pushes -------------------------------------------------------------------

    def seed(self, island: int, payload: Payload, num_islands: int) -> bool:
        """Offer version 0 (fp32), from an island whose session was checked. The first offer wins;
        later ones are ignored (False). Recovering, the offer of a version the log holds: taken if
        its bytes have the logged digest (``num_islands``: the run's count, 0 while not known)."""
        if self.recovering is not None:
            return self._take_back(island, payload, num_islands)
        value = self.decode(EXACT, payload)
        problem = seed_problem(self.number, value)
        if problem:
            raise self.shared.tally.refuse(Reason.BAD_PAYLOAD, problem)
        versions = self.shared.versions
        with self.cond:
            fresh = self.number not in self.run_state.fragments
            if fresh and versions is not None:  # durable before anyone can pull it
                versions.record(self.number, 0, value)
            seeded = self.run_state.seed(self.number, value)
            self.state = self.run_state.fragments[self.number]
            if seeded and versions is not None:
                self.state.publish_hook = functools.partial(versions.record, self.number)
            self.cond.notify_all()
        if seeded:
            log.info("fragment %d seeded by island %d", self.number, island)
            self.shared.membership.wake()
        return seeded

    def admit(self, c: Contribution, declared_bytes: int | None = None) -> int:
        """Push admission steps 4-8, from the header alone: the bytes its payload must have.
        ``declared_bytes``: the size a stream's header declares (None: an in-process push)."""
        problem = contribution_problem(c, self.run_state.layout.hash)
        if problem:
            raise self.shared.tally.refuse(*problem)
        expected = self.payload_bytes(c.codec)
        if declared_bytes is not None:
            wrong_size = declared_size_problem(f"push of fragment {c.fragment}", declared_bytes, expected)
            if wrong_size:
                raise self.shared.tally.refuse(Reason.BAD_PAYLOAD, wrong_size)
        return expected

    def push(self, c: Contribution, payload: Payload) -> PushAck:
        """Push admission steps 9-12 of an admitted contribution with its ``payload``: decoded,
        measured against its base and put into its round. A push that opens a round asks every
        other live island to send this fragment now."""
        membership, tally = self.shared.membership, self.shared.tally
        now, H, offset = self.shared.clock(), self.config.schedule.sync_every, self.offset
        membership.seen(c.island, now)
        digest = payload_digest(payload)  # before decoding, which may reuse the received buffer
        delta = self.decode(c.codec, payload)
        tally.add_bytes(received=payload_size(payload))
        # outside the fragment's lock: pushes of one fragment measure their gradients in parallel
        gradient = outer_gradient(delta)
        norm = norm64(gradient)
        with self.cond:
            clock = membership.run_step(now) or 0
            sent_for = admitted_round(c.round, clock_step=clock, place=membership.reach(c.island, now), offset=offset,
                                      lead_steps=membership.lead_steps, sync_every=H)
            entry = Entry(island=c.island, seq=c.seq, sent_for=sent_for, base_version=c.base_version, outer_gradient=gradient,
                          tokens=c.tokens, steps=c.steps, norm=norm, digest=digest, session=c.session or "")
            frag = self.served()  # step 10
            try:  # steps 11-12; the latest round due on the live islands' clock
                ack, opened = self.rounds.add(frag, entry, now, latest_round(clock, offset, H),
                                              lead_steps=due_step(sent_for, offset, H) - clock)
            except SequenceError as err:
                raise tally.refuse(Reason.SEQUENCE_REUSED if err.reused else Reason.OLD_SEQUENCE, str(err)) from None
            except RoundFull as err:
                raise tally.refuse(Reason.BUSY, f"{err}; retry once it closes") from None
            if not ack.duplicate:
                self.cond.notify_all()
        membership.seen(c.island, now, schedule_step=due_step(sent_for, offset, H))
        tally.accept("duplicate" if ack.duplicate else "late" if ack.late else "on_time")
        if opened:  # the round is due: everyone else sends this fragment now, not at its own pace
            others = membership.live(now) - {c.island}
            membership.ask(RoundRequest(fragment=c.fragment, round=ack.round, due_step=due_step(ack.round, offset, H)), others)
        return ack

    # ---- closing its round ------------------------------------------------------------------

    def close(self, now: float, reason: str, taking_part: int) -> ClosedRound:
        """(With ``cond`` held: its closer's.) Close the round into one outer step (rounds.py), then
        apply everything the close changes beyond the fragment, each part even if another fails
        (rounds.py ``each_part``): the counters, the membership's credit, the withdrawal of the
        round's requests (which wakes the subscriptions) and the checkpoint's signal."""
        assert self.state is not None  # a closer closes only what rounds.py decide() found due, which needs a state
        closed = self.rounds.close(self.state, now, reason, taking_part=taking_part)
        self.cond.notify_all()
        if closed.dropped:
            log.warning("fragment %d round %d: %d contribution(s) left out, the step with them was not finite",
                        closed.fragment, closed.round, closed.dropped)
        log.debug("fragment %d round %d -> version %d from islands %s (%s)", closed.fragment, closed.round,
                  closed.version, closed.islands, reason)
        membership = self.shared.membership
        each_part(closed, [
            ("counters", lambda: self.shared.tally.count_closed(len(closed.islands), closed.dropped)),
            ("membership credit", lambda: membership.credit(closed.islands, now)),
            ("withdrawal of its requests", lambda: membership.withdraw(closed.fragment, closed.round)),
            # written on its own thread: rounds never wait for the disk
            ("checkpoint-due signal", lambda: self.shared.checkpoint_due.set()),
        ])
        return closed

    # ---- recovery after a restart (version_log.py) --------------------------------------------

    def _serve(self, frag: FragmentState) -> None:
        """(With ``cond`` held.) Make ``frag`` the state served, its new versions logged before they are seen."""
        if self.shared.versions is not None:
            frag.publish_hook = functools.partial(self.shared.versions.record, self.number)
        self.state = frag
        self.recovering = self.held_back = self.offered = None
        self.offered_by = set()

    def _take_back(self, island: int, payload: Payload, num_islands: int) -> bool:
        p = self.number
        value = self.decode(EXACT, payload).clone()
        digest = value_digest(value)
        with self.cond:
            if self.recovering is None:  # another island's offer, or the fallback, came first
                return False
            newest = max(self.recovering)
            version = next((v for v, expected in self.recovering.items() if expected == digest), None)
            if version != newest:
                self.offered_by.add(island)
            if version is None:
                log.warning("island %d offered fragment %d, but not the value of a version it published since its "
                            "checkpoint (another digest): not taken", island, p)
            elif version < newest and (self.offered is None or self.offered[0] < version):
                self.offered = (version, value)
            if version != newest:
                # an island holding the newest may still come back: the newest offered is taken once
                # the restart has settled, or at once when every island of the run has offered
                if not (self.offered is not None and num_islands
                        and len(self.offered_by) >= num_islands - self.shared.membership.left_count()):
                    return False
                mine, (version, value) = version, self.offered
            else:
                mine = version
            self._recover(version, value, island)
        self.shared.membership.wake()
        return mine == version

    def _recover(self, version: int, value: torch.Tensor, island: int | None) -> None:
        """(With ``cond`` held.) Serve ``value``, whose digest is logged ``version``'s."""
        assert self.recovering is not None  # only a recovering fragment takes a value back
        p, newest, versions = self.number, max(self.recovering), self.shared.versions
        if version < newest and versions is not None:  # the log's last line is what is served
            versions.record(p, version, value)
        frag = self.held_back if self.held_back is not None else self.run_state.new_fragment(p, value, version)
        if frag.version != version:  # (the checkpoint's own version is served as it is)
            frag.recover(value, version)
        self.run_state.fragments[p] = frag
        self._serve(frag)
        self.cond.notify_all()
        if version == newest:
            log.warning("fragment %d: version %d taken back from island %d (its digest matches the version log)", p,
                        version, island)
        else:
            log.error("fragment %d: version %d taken back, the newest an island offered; versions %d-%d are LOST: no "
                      "island that rejoined held them", p, version, version + 1, newest)

    def fall_back_if_overdue(self, now: float) -> None:
        """Once the restart has settled (RECOVERY_SETTLE s), serve a fragment recovering whose newest
        offer was an older logged version at that version; past the recovery wait, serve it at its
        checkpoint's version (or leave one the checkpoint lacked to be seeded again), logged as
        the log's last line."""
        shared = self.shared
        if now < shared.recovery_settled_at or self.recovering is None:
            return
        p = self.number
        with self.cond:
            if self.recovering is None or (self.offered is None and now < shared.recovery_deadline):
                return
            if self.offered is not None:
                self._recover(*self.offered, island=None)
                shared.membership.wake()
                return
            version, frag = max(self.recovering), self.held_back
            if frag is not None and shared.versions is not None:
                shared.versions.record(p, frag.version, frag.published_value_view())
            if frag is None:
                self.recovering = None
                self.run_state.fragments.pop(p, None)
            else:
                self._serve(frag)
            self.cond.notify_all()
        log.error("fragment %d: no island gave back its version %d within --recovery-wait %.0f s; serving the "
                  "checkpoint's %s: the versions after it are LOST, and islands holding them are sent it whole", p,
                  version, shared.recovery_wait, "no version (the next seed starts it again)" if frag is None else
                  f"version {frag.version}")
        shared.membership.wake()

    def awaits_recovery(self, island: int, until: float) -> bool:
        """While the fragment recovers and ``island`` offered a value other than its last version,
        wait (in real time, a pull's, up to monotonic ``until``) a moment for the recovery to end:
        True while it should wait again."""
        with self.cond:
            left = until - time.monotonic()
            if self.recovering is None or island not in self.offered_by or left <= 0:
                return False
            self.cond.wait(min(left, 0.25))
            return True
