"""How the synchronizer takes in what islands send it: seeds and pushes, once admitted.

A seed offers version 0 of a fragment (fp32, the first offer wins); a push is a contribution to a
round. A push reaches :meth:`Intake.push` admitted from its header (push_admission.py, where every
rule it can be refused by is, in order), with its payload: it is decoded, measured against its
base and put into its fragment's round, and answered at once with a
:class:`~lightning_diloco.core.protocol.PushAck` (which round, late or not). A push that opens a
round asks every other live island to send that fragment now.

:class:`Intake` is held by :class:`~lightning_diloco.synchronizer.service.Synchronizer` once the
run has a layout, and is given what it works on: the run's state, the membership, the push
admission, the schedule's offsets, a clock and the service's counters.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from lightning_diloco.core.codecs import EXACT, Payload, payload_size
from lightning_diloco.core.merge import norm64
from lightning_diloco.core.outer import outer_gradient
from lightning_diloco.core.protocol import PushAck, RoundRequest
from lightning_diloco.core.schedule import due_step, latest_round
from lightning_diloco.core.state import SynchronizerState
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.admission import seed_problem
from lightning_diloco.synchronizer.membership import Membership
from lightning_diloco.synchronizer.push_admission import AdmittedPush, PushAdmission, admitted_round
from lightning_diloco.synchronizer.requests import payload_digest
from lightning_diloco.synchronizer.rounds import Entry, FragmentRounds
from lightning_diloco.synchronizer.version_log import VersionLog

log = logging.getLogger(__name__)


class Intake:
    """Seeds and pushes into the run's state and rounds.

    ``count_accepted(kind)`` and ``count_bytes_in(n)`` add to the service's counters (Status);
    ``offsets``: each fragment's offset in the schedule of ``sync_every`` steps."""

    def __init__(self, *, state: SynchronizerState, membership: Membership, admission: PushAdmission,
                 offsets: tuple[int, ...], sync_every: int, clock: Callable[[], float],
                 count_accepted: Callable[[str], None], count_bytes_in: Callable[[int], None],
                 versions: VersionLog | None = None) -> None:
        """``versions``: the version log a seed is written to before it is seen (version_log.py)."""
        self.state, self.membership, self.admission, self.versions = state, membership, admission, versions
        self.offsets, self.sync_every, self.clock = offsets, sync_every, clock
        self.count_accepted, self.count_bytes_in = count_accepted, count_bytes_in

    def seed(self, rounds: FragmentRounds, island: int, payload: Payload) -> bool:
        """Offer version 0 of ``rounds``' fragment (fp32), from an island whose session was
        checked. The first offer wins; later ones are ignored."""
        fragment = rounds.fragment
        value = self.admission.decode(EXACT, payload, self.state.layout.fragment_numel(fragment))
        problem = seed_problem(fragment, value)
        if problem:
            raise self.admission.refuse(Reason.BAD_PAYLOAD, problem)
        with rounds.cond:
            fresh = fragment not in self.state.fragments
            if fresh and self.versions is not None:  # durable before anyone can pull it
                self.versions.record(fragment, 0, value)
            seeded = self.state.seed(fragment, value)
            rounds.frag = self.state.fragments[fragment]
            if seeded and self.versions is not None:
                rounds.frag.publish_hook = functools.partial(self.versions.record, fragment)
            rounds.cond.notify_all()
        if seeded:
            log.info("fragment %d seeded by island %d", fragment, island)
            self.membership.wake()
        return seeded

    def push(self, admitted: AdmittedPush, payload: Payload) -> PushAck:
        """Put an admitted contribution, with its ``payload``, into its fragment's round; answered
        at once, merged when it closes. A retry with the same sequence number gets the same answer
        and is never merged twice."""
        c, rounds = admitted.header, admitted.rounds
        now, H, offset = self.clock(), self.sync_every, self.offsets[c.fragment]
        self.membership.seen(c.island, now)
        digest = payload_digest(payload)  # before decoding, which may reuse the received buffer
        delta = self.admission.decode(c.codec, payload, admitted.numel)
        self.count_bytes_in(payload_size(payload))
        # outside the fragment's lock: pushes of one fragment measure their gradients in parallel
        gradient = outer_gradient(delta)
        norm = norm64(gradient)
        with rounds.cond:
            clock = self.membership.run_step(now) or 0
            sent_for = admitted_round(c.round, clock_step=clock, place=self.membership.reach(c.island, now), offset=offset,
                                      lead_steps=self.membership.lead_steps, sync_every=H)
            entry = Entry(island=c.island, seq=c.seq, sent_for=sent_for, base_version=c.base_version, outer_gradient=gradient,
                          tokens=c.tokens, steps=c.steps, norm=norm, digest=digest, session=c.session or "")
            # the latest round due on the live islands' clock
            ack, opened = self.admission.into_round(rounds, entry, now, latest_round(clock, offset, H),
                                                    lead_steps=due_step(sent_for, offset, H) - clock)
        self.membership.seen(c.island, now, schedule_step=due_step(sent_for, offset, H))
        self.count_accepted("duplicate" if ack.duplicate else "late" if ack.late else "on_time")
        if opened:  # the round is due: everyone else sends this fragment now, not at its own pace
            others = self.membership.live(now) - {c.island}
            request = RoundRequest(fragment=c.fragment, round=ack.round, due_step=due_step(ack.round, offset, H))
            self.membership.ask(request, others)
        return ack
