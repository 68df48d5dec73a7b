"""How the synchronizer takes in what islands send it: seeds and pushes.

A seed offers version 0 of a fragment (fp32, the first offer wins); a push is a contribution to a
round. Each is checked from its header before its payload is read (``admit_seed``,
``admit_push`` and ``expected_payload_bytes``: the server calls them on the first chunk, so a
stream from no session, or for no fragment, holds no worker while its bytes trickle in, and a
seed of a fragment already seeded is answered with its version, its payload never read), then
decoded, measured against its base and put into its fragment's state or round. Every refusal is a
:class:`~lightning_diloco.synchronizer.requests.Refusal` counted by reason.

:class:`Intake` is a part of :class:`~lightning_diloco.synchronizer.service.Synchronizer`, which
mixes it in: it uses the service's state, rounds, membership and counters, and its ``refuse``,
``_rounds`` and ``_check_session``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lightning_diloco.core.codecs import EXACT, NonFiniteError, Payload, get_codec, payload_size
from lightning_diloco.core.config import CODECS, RunConfig
from lightning_diloco.core.merge import norm64
from lightning_diloco.core.outer import outer_gradient
from lightning_diloco.core.protocol import PushAck, RoundRequest
from lightning_diloco.core.schedule import due_step, latest_round
from lightning_diloco.core.state import FragmentState, SynchronizerState
from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.admission import admitted_round, seed_problem
from lightning_diloco.synchronizer.membership import Membership
from lightning_diloco.synchronizer.requests import Contribution, Refusal, contribution_problem, payload_digest
from lightning_diloco.synchronizer.rounds import Entry, FragmentRounds, RoundFull, SequenceError

log = logging.getLogger(__name__)


class Intake:
    """Seeds and pushes, as :class:`~lightning_diloco.synchronizer.service.Synchronizer` takes them in."""

    # the service's, set in its __init__
    config: RunConfig
    state: SynchronizerState | None
    membership: Membership
    lock: threading.RLock
    clock: Callable[[], float]
    offsets: tuple[int, ...]
    accepted: Counter[str]
    bytes_in: int

    if TYPE_CHECKING:  # the service's methods, for the type checker only
        def refuse(self, reason: Reason, message: str) -> Refusal: ...
        def _rounds(self, fragment: int) -> FragmentRounds: ...
        def _seeded(self, rounds: FragmentRounds) -> FragmentState: ...
        def _check_session(self, island: int, session: str | None, what: str,
                           check: Callable[[int, str | None], None] | None = None) -> None: ...

    # ---- header checks, before the payload is read ---------------------------------------------

    def admit_seed(self, island: int, fragment: int, session: str | None) -> int | None:
        """A seed's header checks, before its payload is read; the fragment's version when it is
        seeded already (the first offer won: the server answers so without reading the payload,
        where 200 held seeds of a seeded fragment were each read in full, 1.7 GB, to be ignored),
        else None."""
        rounds = self._rounds(fragment)
        self._check_session(island, session, "seed")
        with rounds.cond:
            return None if rounds.frag is None else rounds.frag.version

    def admit_push(self, c: Contribution) -> FragmentRounds:
        """Every check a push's header allows, before its payload is read (the server calls it on
        the first chunk: a stream from no session, or for no fragment, holds no worker while its
        bytes trickle in); ``c.payload`` is not looked at."""
        rounds = self._rounds(c.fragment)
        self._check_session(c.island, c.session, "push")
        problem = contribution_problem(c, self.state.layout.hash)
        if problem:
            raise self.refuse(*problem)
        self._check_codec(c.codec)
        return rounds

    def expected_payload_bytes(self, codec_name: str, fragment: int) -> int:
        """Bytes a payload of ``fragment`` must have in ``codec_name``; refuses unknown ones."""
        self._rounds(fragment)
        self._check_codec(codec_name)
        numel = self.state.layout.fragment_numel(fragment)
        return get_codec(codec_name, self.config.codec.block_size).encoded_size(numel)

    # ---- seeds and pushes -----------------------------------------------------------------------

    def seed(self, island: int, fragment: int, payload: Payload, session: str | None = None) -> bool:
        """Offer version 0 of a fragment (fp32). The first offer wins; later ones are ignored."""
        rounds = self._rounds(fragment)
        self._check_session(island, session, "seed")
        numel = self.state.layout.fragment_numel(fragment)
        value = self._decode(EXACT, payload, numel)
        problem = seed_problem(fragment, value)
        if problem:
            raise self.refuse(Reason.BAD_PAYLOAD, problem)
        with rounds.cond:
            seeded = self.state.seed(fragment, value)
            rounds.frag = self.state.fragments[fragment]
            rounds.cond.notify_all()
        if seeded:
            log.info("fragment %d seeded by island %d", fragment, island)
            with self.membership.lock:
                self.membership.changed.notify_all()
        return seeded

    def push(self, c: Contribution) -> PushAck:
        """Put a contribution into its fragment's round; answered at once, merged when it closes.

        A retry with the same sequence number gets the same answer and is never merged twice.
        """
        rounds = self.admit_push(c)
        now, H = self.clock(), self.config.schedule.sync_every
        self.membership.seen(c.island, now)
        digest = payload_digest(c.payload)  # before decoding, which may reuse the received buffer
        delta = self._decode(c.codec, c.payload, self.state.layout.fragment_numel(c.fragment))
        with self.lock:
            self.bytes_in += payload_size(c.payload)
        # outside the fragment's lock: pushes of one fragment measure their gradients in parallel
        gradient = outer_gradient(delta)
        norm = norm64(gradient)
        with rounds.cond:
            self._seeded(rounds)
            clock, offset = self.membership.run_step(now) or 0, self.offsets[c.fragment]
            sent_for = admitted_round(c.round, clock_step=clock, place=self.membership.reach(c.island, now), offset=offset,
                                      lead_steps=self.membership.lead_steps, sync_every=H)
            entry = Entry(island=c.island, seq=c.seq, sent_for=sent_for, base_version=c.base_version, outer_gradient=gradient,
                          tokens=c.tokens, steps=c.steps, norm=norm, digest=digest, session=c.session or "")
            try:
                # the latest round due on the live islands' clock
                ack, opened = rounds.add(entry, now, latest_round(clock, offset, H))
            except SequenceError as err:
                raise self.refuse(Reason.SEQUENCE_REUSED if err.reused else Reason.OLD_SEQUENCE, str(err)) from None
            except RoundFull as err:
                raise self.refuse(Reason.BUSY, f"{err}; retry once it closes") from None
        self.membership.seen(c.island, now, schedule_step=due_step(sent_for, self.offsets[c.fragment], H))
        with self.lock:
            self.accepted["duplicate" if ack.duplicate else "late" if ack.late else "on_time"] += 1
        if opened:  # the round is due: everyone else sends this fragment now, not at its own pace
            others = self.membership.live(now) - {c.island}
            request = RoundRequest(fragment=c.fragment, round=ack.round, due_step=due_step(ack.round, self.offsets[c.fragment], H))
            self.membership.ask(request, others)
        return ack

    # ---- codecs ----------------------------------------------------------------------------------

    def _check_codec(self, codec_name: str) -> None:
        if codec_name not in CODECS:
            raise self.refuse(Reason.UNKNOWN_CODEC, f"codec {codec_name[:40]!r} is not one of {', '.join(CODECS)}")

    def _decode(self, codec_name: str, payload: Payload, numel: int) -> torch.Tensor:
        self._check_codec(codec_name)
        try:
            return get_codec(codec_name, self.config.codec.block_size).decode(payload, numel)
        except ValueError as err:
            raise self.refuse(Reason.NON_FINITE if isinstance(err, NonFiniteError) else Reason.BAD_PAYLOAD, str(err)) from None
