"""An island's link to its synchronizer, written once over either transport: routing by fragment,
retries, sessions and rejoin, subscriptions, leave and close.

A synchronizer that is briefly away (restarting, unreachable) is retried with exponential
backoff and jitter; after a restart the link joins again by itself. A refusal is not retried:
it surfaces as :class:`SynchronizerError` carrying the synchronizer's reason.

A sharded run goes on without a dead shard: a join succeeds when at least one shard answers, the
shards that did not (or that stopped answering later) are *absent*, and calls for their fragments
fail at once instead of waiting out the retries, until the shard's subscription reader finds it
back and joins it (subscription.py). Its fragments train locally meanwhile. The sessions with the
shards (joining, joining again, absence) are a :class:`~lightning_diloco.transport.sessions.ShardSessions`
the link holds.

New global versions and the synchronizer's requests arrive through a subscription
(subscription.py): one long-lived stream per shard, read on its own thread, reopened whenever it
breaks.

The transport (transport/shard_transport.py) is gRPC to remote shards
(:class:`~lightning_diloco.transport.client.SynchronizerClient`) or calls into a synchronizer in
this process (:class:`~lightning_diloco.synchronizer.local_link.LocalLink`): an island cannot tell
them apart, and tests/learner/test_link_conformance.py checks this one mechanism over both.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import torch

from lightning_diloco.core.codecs import EXACT, get_codec
from lightning_diloco.core.fragments import TensorSpec
from lightning_diloco.core.protocol import (
    RUNNING_PATIENCE,
    Beat,
    Contribution,
    JoinInfo,
    PushAck,
    RoundRequest,
    SynchronizerStatus,
    VersionUpdate,
)
from lightning_diloco.core.state import shard_of
from lightning_diloco.reasons import REJOIN, Reason, SynchronizerError
from lightning_diloco.transport.sessions import ShardSessions
from lightning_diloco.transport.shard_transport import JoinRequest, Refused, ShardTransport, Unanswered
from lightning_diloco.transport.subscription import Subscription

log = logging.getLogger(__name__)
T = TypeVar("T")

SAY_EVERY = 5.0
"""Seconds between two lines saying a call still waits for a synchronizer that does not answer."""


class IslandLink:
    """A :class:`~lightning_diloco.learner.link.SynchronizerLink` over ``transport``."""

    running_patience = RUNNING_PATIENCE
    """Seconds a join refused as ``island_running`` is retried (core/protocol.py)."""

    def __init__(self, transport: ShardTransport, *, max_retries: int = 8, backoff: float = 0.2,
                 max_backoff: float = 5.0) -> None:
        """``max_retries``: attempts after the first on an unreachable synchronizer, with delays
        ``backoff * 2**k`` capped at ``max_backoff``, each jittered by up to 50%."""
        self.transport = transport
        self.addresses = list(transport.addresses)
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff
        self.rng = random.Random()  # the retries' jitter
        self._lock = threading.Lock()
        self.shard_sessions = ShardSessions(transport)
        self._subscriptions: list[Subscription] = []  # kept after close: every close joins them
        self._closed = threading.Event()

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    @property
    def sessions(self) -> list[str]:
        """This island's session with each shard ("": absent, not joined or stopped answering)."""
        return list(self.shard_sessions.sessions)

    def shard_of(self, fragment: int) -> int:
        return shard_of(fragment, self.num_shards)

    def _session(self, shard: int) -> str:
        return self.shard_sessions.sessions[shard]

    # ---- retries ------------------------------------------------------------------------------

    def _call(self, what: str, call: Callable[[], T], shard: int | None = None, patience: float = 0.0,
              patience_setting: str = "") -> T:
        """Run ``call``, retrying while the synchronizer is unreachable.

        Between attempts it waits for the backoff delay or until the shard can be reached again,
        whichever comes first (the transport's ``wait_ready``): a synchronizer that is back is
        used at once, not after the full backoff.
        ``patience``: seconds during which it keeps retrying even after ``max_retries``; while
        it does, it says so from the first failure on, every ``SAY_EVERY`` seconds, with how long
        it will go on and ``patience_setting``, the setting that bounds it.
        """
        attempt = 0
        began = time.monotonic()
        keep_trying_until = began + patience
        said_at: float | None = None
        while True:
            self._check_open(what)
            if shard is not None and self.shard_sessions.request is None:  # absent too, but nothing was asked
                raise SynchronizerError(None, Reason.NOT_JOINED, f"{what}: this client has not joined the run (or "
                                        "left it); call join first")
            if shard is not None and self.shard_sessions.absent(shard):
                raise SynchronizerError(None, Reason.UNREACHABLE,
                                        f"{what}: shard {shard} at {self.addresses[shard]} is not answering; this island "
                                        "trains its fragments locally and joins the shard again once it is back")
            joins = self.shard_sessions.joins[shard] if shard is not None else 0
            try:
                return call()
            except ValueError:  # the transport closed under the call (gRPC's "Cannot invoke RPC on closed channel!")
                self._check_open(what)
                raise
            except TimeoutError as err:
                self._check_open(what)  # close() ends the calls in flight: say why
                raise TimeoutError(f"{what}: {err}") from None
            except Refused as refusal:
                self._check_open(what)
                if refusal.reason not in REJOIN or not self.shard_sessions.request or shard is None:
                    raise SynchronizerError(refusal.code, refusal.reason,
                                            f"{what} refused ({refusal.label}): {refusal.details}") from None
                log.info("%s: %s (the synchronizer restarted, or this island joined again elsewhere); joining again",
                         what, refusal.reason)
                failure = self._rejoin(what, shard, joins)  # then the call is made again, with the new session
                code, label, details = (refusal.code, refusal.label, refusal.details) if failure is None else \
                    (failure.code, failure.label, failure.details)
            except Unanswered as err:
                self._check_open(what)
                code, label, details = err.code, err.label, err.details
            if attempt >= self.max_retries:
                left = keep_trying_until - time.monotonic()
                if left <= 0:
                    if shard is not None and self.shard_sessions.request is not None:
                        self.shard_sessions.mark_absent(shard, joins)
                    hint = self.transport.hint(shard or 0, details)
                    raise SynchronizerError(code, Reason.UNREACHABLE,
                                            f"{what}: gave up after {attempt + 1} attempts: {details}{hint}") from None
            now = time.monotonic()
            left = keep_trying_until - now
            if left > 0 and (said_at is None or now - said_at >= SAY_EVERY):  # why the caller waits, while it does
                said_at = now
                bound = f" ({patience_setting} bounds it)" if patience_setting else ""
                log.warning("%s: no synchronizer reachable at %s yet (%s: %s%s); tried for %.0f s, trying for %.0f s more%s",
                            what, ",".join(self.addresses), label, details, self.transport.hint(shard or 0, details),
                            now - began, left, bound)
            delay = min(self.max_backoff, self.backoff * 2 ** min(attempt, 30)) * (0.5 + self.rng.random() / 2)
            log.debug("%s failed (%s); retrying within %.2fs", what, label, delay)
            self.transport.wait_ready(shard, delay, self._closed)
            attempt += 1

    def _rejoin(self, what: str, shard: int, joins: int) -> Unanswered | None:
        """Join ``shard`` again (single-flight, sessions.py); the failure to retry like the call's
        when the synchronizer did not answer it, None once joined."""
        try:
            self.shard_sessions.rejoin(shard, joins)
            return None
        except ValueError:  # the link closed under the join (a closed channel)
            self._check_open(what)
            raise
        except TimeoutError as err:  # refused, as a join that could not be made in time
            self._check_open(what)  # or the close cancelled it
            raise SynchronizerError(None, Reason.parse(str(err)), f"{what}: joining again refused "
                                    f"(DEADLINE_EXCEEDED): {err}") from None
        except Unanswered as err:  # a synchronizer still starting: retried like the call
            self._check_open(what)
            return err
        except Refused as refusal:
            self._check_open(what)
            raise SynchronizerError(refusal.code, refusal.reason, f"{what}: joining again refused "
                                    f"({refusal.label}): {refusal.details}") from None

    # ---- calls --------------------------------------------------------------------------------

    def join(self, island: int, world_size: int, specs: Sequence[TensorSpec], patience: float = 0.0,
             num_islands: int = 0, patience_setting: str = "") -> JoinInfo:
        """Join every shard that answers (at least one). ``patience``: seconds to keep waiting
        for a synchronizer that is not reachable yet (an island may start before it, or while it
        restarts), said every few seconds naming ``patience_setting``, the setting that gave it.
        ``num_islands``: the run's island count this island was started with (0: not said); a
        run of another count refuses it.

        A join refused because the island is still running elsewhere is retried for
        :attr:`running_patience` seconds: an island restarted after a crash gets in once its old
        process has fallen silent; a second process beside a live one is refused after that."""
        request = JoinRequest(island=island, world_size=world_size, specs=tuple(specs), num_islands=num_islands)
        return self._until_not_running(island, lambda: self._call("join", lambda: self.shard_sessions.join(request),
                                                                 patience=patience, patience_setting=patience_setting))

    def _until_not_running(self, island: int, join: Callable[[], T]) -> T:
        give_up = time.monotonic() + self.running_patience
        attempt = 0
        while True:
            try:
                return join()
            except SynchronizerError as err:
                if err.reason != Reason.ISLAND_RUNNING or time.monotonic() >= give_up:
                    raise
                if attempt == 0:  # a restart after a crash waits here: say why, once
                    log.warning("%s; retrying for up to %.0f s, until island %d's old process has fallen silent", err,
                                self.running_patience, island)
            # at most a second apart: the old process's silence is what it waits for, not a server's recovery
            delay = min(1.0, self.backoff * 2 ** min(attempt, 30)) * (0.5 + self.rng.random() / 2)
            self._closed.wait(max(0.0, min(delay, give_up - time.monotonic())))
            attempt += 1

    def seed(self, island: int, fragment: int, value: torch.Tensor) -> tuple[bool, int]:
        """Offer version 0 of a fragment; (whether this offer was the one taken, the version now)."""
        payload = get_codec(EXACT).encode(value)
        shard = self.shard_of(fragment)
        return self._call(f"seed of fragment {fragment}",
                          lambda: self.transport.seed(shard, island, fragment, payload, self._session(shard)), shard)

    def push(self, contribution: Contribution) -> PushAck:
        """Send one contribution, sent for its round, with this island's session with the
        fragment's shard; answered once it is in a round.

        Safe to call again with the same ``seq``: the synchronizer never merges it twice.
        """
        fragment = contribution.fragment
        shard = self.shard_of(fragment)
        return self._call(f"push of fragment {fragment}",
                          lambda: self.transport.push(shard, contribution_in(contribution, self._session(shard))), shard)

    def pull(self, fragment: int) -> tuple[int, torch.Tensor]:
        """(version, fp32 value) of a fragment: what a joining island starts from (a copy, the
        island's to change). A joined island's call: it carries the island and its session with
        the fragment's shard."""
        what = f"pull of fragment {fragment}"
        self._check_open(what)
        joined = self.shard_sessions.request
        if joined is None:
            raise SynchronizerError(None, Reason.NOT_JOINED, f"{what}: this client has not joined the run; call join first "
                                    "(the synchronizer answers pulls of joined islands only)")
        shard = self.shard_of(fragment)
        # the session is read at each attempt: a rejoin between attempts brings a new one
        return self._call(what, lambda: self.transport.pull(shard, joined.island, fragment, self._session(shard)), shard)

    def heartbeat(self, island: int, steps: int, step_time: float, schedule_step: int = 0) -> Beat:
        """Report progress to every joined shard; the versions of the fragments they hold (an
        absent shard's are missing) and the run's furthest clock. Raises when no shard answers."""
        versions: dict[int, int] = {}
        run_step, answered, error = 0, 0, None
        for shard in range(self.num_shards):
            def call(shard=shard):
                return self.transport.heartbeat(shard, island, steps, step_time, schedule_step, self._session(shard))

            try:
                beat = self._call(f"heartbeat to shard {shard}", call, shard)
            except SynchronizerError as err:
                if err.reason != Reason.UNREACHABLE or self.num_shards == 1:
                    raise
                error = err
                continue
            answered += 1
            versions.update(beat.versions)
            run_step = max(run_step, beat.run_step)
        if not answered:
            assert error is not None
            raise error
        return Beat(versions=versions, run_step=run_step)

    def subscribe(self, island: int, versions: Callable[[], dict[int, int]], *,
                  on_request: Callable[[RoundRequest], None], on_version: Callable[[VersionUpdate], None],
                  on_reconnect: Callable[[], None] = lambda: None) -> Subscription:
        """Start reading this island's events from every shard (one thread each).

        ``versions()`` tells, at each (re)connect, which version of each fragment the island holds;
        ``on_request(request)`` and ``on_version(update)`` run on the reader
        threads; ``on_reconnect()`` when a stream that had worked is open again (contributions
        waiting in rounds may have been lost with a restarted synchronizer).
        """
        subscription = Subscription(island, self.shard_sessions, transport=self.transport, closed=lambda: self.closed,
                                    backoff=self.backoff, rng=self.rng, versions=versions, on_request=on_request,
                                    on_version=on_version, on_reconnect=on_reconnect)
        with self._lock:  # started under the lock, so a close at the same time finds it and joins it
            self._check_open("subscribe")  # its readers would retry the closed transport for ever, never joined
            self._subscriptions.append(subscription)
            return subscription.start()

    def leave(self, island: int) -> None:
        """Tell every joined shard that this island leaves the run (its training ended, or it is
        stopping), so that no round waits for it. One attempt per shard, within the transport's
        leave deadline: a synchronizer that is away is not waited for (it stops waiting for the
        island after its liveness timeout instead). Raises the first failure, after trying every
        shard.

        From here on the link does not join again by itself: the subscription ends, and a call
        the synchronizer answers ``not_joined`` fails instead of joining again (which would put
        the island back into the run). :meth:`join` starts over."""
        self._check_open("leave")
        sessions = self.shard_sessions.leave()  # no rejoin is under way, and none starts after this
        with self._lock:
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            subscription.stop()
        failure = None
        for shard, session in enumerate(sessions):
            if not session:  # absent: it does not know this island's session anyway
                continue
            try:
                self.transport.leave(shard, island, session)
            except (Unanswered, TimeoutError) as err:
                label, details = (err.label, err.details) if isinstance(err, Unanswered) else ("DEADLINE_EXCEEDED", str(err))
                failure = failure or SynchronizerError(getattr(err, "code", None), Reason.UNREACHABLE,
                                                       f"leave of shard {shard} failed ({label}): {details}")
            except Refused as refusal:
                failure = failure or SynchronizerError(refusal.code, refusal.reason,
                                                       f"leave of shard {shard} failed ({refusal.label}): {refusal.details}")
            except ValueError:  # the transport closed under the call
                self._check_open("leave")
                raise
        if failure is not None:
            raise failure

    def status(self, shard: int = 0) -> SynchronizerStatus:
        """One shard's status."""
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard={shard}: this link has {self.num_shards} shard(s), 0..{self.num_shards - 1}")
        return self._call("status", lambda: self.transport.status(shard))

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _check_open(self, what: str) -> None:
        if self._closed.is_set():
            raise SynchronizerError(None, Reason.UNREACHABLE, f"{what}: {self.transport.description} is closed")

    def close(self) -> None:
        """End the subscriptions and join their threads, then release the transport; later calls
        fail as unreachable, saying the link is closed.

        When it returns, from whichever caller (two closing at once included), no reader thread
        of this link runs, but one still inside a callback after ``JOIN_TIMEOUT``: that one is
        logged, naming the callback, and hands no further event (core/readers.py).
        """
        with self._lock:
            self._closed.set()
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            subscription.stop()
        self.transport.close()  # also ends a call backing off and a reader's join in flight (a rejoin)
        for subscription in subscriptions:  # each close joins them: a second one returns once they ended too
            subscription.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def contribution_in(contribution: Contribution, session: str) -> Contribution:
    """``contribution`` as sent in ``session``."""
    return contribution if contribution.session == session else replace(contribution, session=session)
