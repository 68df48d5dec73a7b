"""An island's link to a synchronizer in its own process: direct calls, no gRPC.

An island given no synchronizer address runs an embedded one (learner/island_membership.py). Over
loopback gRPC its own traffic cost the training process 3-4 ms of CPU per 170 ms step beside the
training loop, in gRPC's workers and threads and in serializing (benchmarks/RESULTS.md);
:class:`LocalLink` calls the :class:`~lightning_diloco.synchronizer.service.Synchronizer`
instead, and keeps what the gRPC client gives an island (tests/learner/test_link_conformance.py
runs one exchange against both):

- the same checks: a payload reaches the service as the bytes the island encoded, and the service
  validates them as it does the server's (codec, size, layout hash, non-finite values);
- refusals surface as :class:`~lightning_diloco.reasons.SynchronizerError` with the service's
  reason; one that asks the island to join again (it was forgotten after a long silence, or joined
  elsewhere) is answered by joining again and retrying once, as the client does;
- a join says the island's num_islands, as the client's does; it is trusted as the island's own
  (no ``island_running`` check: an embedded synchronizer serves its own process's island only);
- new versions and round requests arrive on a reader thread of its own (reopened, with the
  versions the island holds, when the island joins again); :meth:`close` ends and joins it;
- :meth:`leave` ends the island's part in the run as the client's does: the subscription ends and
  the link no longer joins again by itself.

Payloads cross as uint8 tensors, uncopied: the service never writes into a payload, and decoding
one copies what is kept (core/codecs.py), so neither side sees the other's later writes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import torch

from lightning_diloco.core.codecs import EXACT, get_codec
from lightning_diloco.core.fragments import TensorSpec
from lightning_diloco.core.protocol import (
    Beat,
    Contribution,
    JoinInfo,
    PushAck,
    RoundRequest,
    SynchronizerStatus,
    VersionUpdate,
)
from lightning_diloco.core.readers import Readers
from lightning_diloco.core.threads import single_threaded_torch
from lightning_diloco.reasons import REJOIN, Reason, SynchronizerError
from lightning_diloco.synchronizer.requests import Refusal
from lightning_diloco.synchronizer.service import Synchronizer

log = logging.getLogger(__name__)
T = TypeVar("T")

REOPEN_DELAY = 0.1  # seconds between a subscription's end and its reopening (never a busy loop)


class LocalLink:
    """A :class:`~lightning_diloco.learner.link.SynchronizerLink` over a service in this process."""

    def __init__(self, service: Synchronizer, *, tick: float = 0.5) -> None:
        """``tick``: seconds the subscription waits for news before looking again (a close wakes
        it at once)."""
        self.service, self.tick = service, tick
        self.session: str | None = None  # the join's; None (never joined through this link): trusted
        self.joins = 0  # successful joins so far: which session a refused call was made with
        self._joined: tuple[int, int, list[TensorSpec], int] | None = None
        self._join_lock = threading.Lock()  # one join at a time: see _rejoin
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._subscriptions: list[LocalSubscription] = []

    # ---- refusals -------------------------------------------------------------------------------

    def _call(self, what: str, call: Callable[[], T]) -> T:
        """Run ``call``; a refusal becomes a :class:`SynchronizerError`, after one retry when the
        service no longer knows this island's session."""
        if self._closed.is_set():
            raise SynchronizerError(None, Reason.UNREACHABLE, f"{what}: the link to the embedded synchronizer is closed")
        joins = self.joins
        try:
            return call()
        except Refusal as refusal:
            if refusal.reason not in REJOIN or self._joined is None:
                raise _refused(what, refusal) from None
            log.info("%s: %s (this island was forgotten, or joined again elsewhere); joining again", what, refusal.reason)
        try:
            self._rejoin(joins)
            return call()
        except Refusal as refusal:
            raise _refused(what, refusal) from None

    def _rejoin(self, joins: int) -> None:
        """Single-flight, as the client's: the callers that noticed at once join only once (and
        none once the island left: the retried call is then refused again)."""
        with self._join_lock:
            if self.joins == joins and self._joined is not None:
                self._join(*self._joined)

    def _join(self, island: int, world_size: int, specs: list[TensorSpec], num_islands: int) -> JoinInfo:
        """(With ``_join_lock`` held.)"""
        info = self.service.join(island, world_size, specs, num_islands=num_islands)
        self._joined, self.session = (island, world_size, specs, num_islands), info.session
        self.joins += 1
        return info

    # ---- calls ----------------------------------------------------------------------------------

    def join(self, island: int, world_size: int, specs: Sequence[TensorSpec], patience: float = 0.0,
             num_islands: int = 0) -> JoinInfo:
        """Join the run. ``patience`` is the client's (seconds to wait for a synchronizer not
        reachable yet): one in this process answers at once. ``num_islands``: as the client's."""

        def join_once() -> JoinInfo:
            with self._join_lock:
                return self._join(island, world_size, list(specs), num_islands)

        return self._call("join", join_once)

    def heartbeat(self, island: int, steps: int, step_time: float, schedule_step: int = 0) -> Beat:
        return self._call("heartbeat", lambda: self.service.heartbeat(island, steps, step_time, schedule_step,
                                                                      session=self.session))

    def seed(self, island: int, fragment: int, value: torch.Tensor) -> tuple[bool, int]:
        payload = get_codec(EXACT).encode(value)

        def call() -> tuple[bool, int]:
            seeded = self.service.seed(island, fragment, payload, session=self.session)
            return seeded, self.service.versions()[fragment]

        return self._call(f"seed of fragment {fragment}", call)

    def pull(self, fragment: int) -> tuple[int, torch.Tensor]:
        """(version, fp32 value) of a fragment: a copy, the island's to change."""
        return self._call(f"pull of fragment {fragment}", lambda: self.service.pull(fragment))

    def push(self, contribution: Contribution) -> PushAck:
        """Put a contribution into its round, with this link's session (answered at once); a retry
        with the same ``seq`` is never merged twice."""
        return self._call(f"push of fragment {contribution.fragment}",
                          lambda: self.service.push(replace(contribution, session=self.session)))

    def leave(self, island: int) -> None:
        """Tell the synchronizer this island leaves the run, as the client's ``leave``: from here
        on the link does not join again by itself (a refused call raises), and its subscription
        ends. :meth:`join` starts over."""
        with self._join_lock:
            self._joined = None
        with self._lock:
            subscriptions = list(self._subscriptions)
        for subscription in subscriptions:
            subscription.stop()
        self._call("leave", lambda: self.service.leave(island, session=self.session))

    def status(self, shard: int = 0) -> SynchronizerStatus:
        """The synchronizer's status, as the client's ``status`` reads it (one shard: ``shard`` 0)."""
        if shard != 0:
            raise ValueError(f"shard={shard}: an embedded synchronizer is one shard, 0")
        return self._call("status", self.service.status)

    def subscribe(self, island: int, versions: Callable[[], dict[int, int]], *,
                  on_request: Callable[[RoundRequest], None], on_version: Callable[[VersionUpdate], None],
                  on_reconnect: Callable[[], None] = lambda: None) -> LocalSubscription:
        """Start delivering this island's events on a reader thread, as the client's subscription."""
        subscription = LocalSubscription(self, island, versions, on_request, on_version, on_reconnect)
        with self._lock:  # started under the lock, so a close at the same time finds it and joins it
            if self._closed.is_set():  # its reader would retry the closed link for ever, never joined
                raise SynchronizerError(None, Reason.UNREACHABLE, "subscribe: the link to the embedded synchronizer is closed")
            self._subscriptions.append(subscription)
            return subscription.start()

    def close(self) -> None:
        """End the subscriptions and join their threads; later calls fail as unreachable. When it
        returns, from whichever caller, no reader runs but one held inside a callback, as the
        client's close (core/readers.py)."""
        with self._lock:
            self._closed.set()
            subscriptions = list(self._subscriptions)  # kept: every close joins them
        for subscription in subscriptions:
            subscription.close()

    def __enter__(self) -> LocalLink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refused(what: str, refusal: Refusal) -> SynchronizerError:
    return SynchronizerError(None, refusal.reason, f"{what} refused ({refusal.reason}): {refusal}")


class LocalSubscription:
    """One island's events read off the service on a thread, reopened whenever they end."""

    def __init__(self, link: LocalLink, island: int, versions: Callable[[], dict[int, int]],
                 on_request: Callable[[RoundRequest], None], on_version: Callable[[VersionUpdate], None],
                 on_reconnect: Callable[[], None]) -> None:
        self.link, self.island, self.versions = link, island, versions
        self.on_request, self.on_version, self.on_reconnect = on_request, on_version, on_reconnect
        self.readers = Readers(f"island {island}'s subscription")
        self._stop = self.readers.stopping
        self.readers.add(f"diloco-subscription-{island}-local", self._read)

    def start(self) -> LocalSubscription:
        self.readers.start()
        return self

    def close(self) -> None:
        self.stop()
        self.readers.join()

    def stop(self) -> None:
        """Tell the reader to end (without waiting for it)."""
        self._stop.set()
        self.link.service.wake_subscriptions()  # where the reader waits for news

    def _active(self) -> bool:
        return not self._stop.is_set()

    def _read(self) -> None:
        single_threaded_torch()  # it decodes fragments beside the training loop
        link, opened_before = self.link, False
        while not self._stop.is_set():
            try:
                events = link._call("subscription", lambda: link.service.subscribe(
                    self.island, self.versions(), active=self._active, tick=link.tick, session=link.session))
                if opened_before and not self.readers.hand(self.on_reconnect):
                    return
                opened_before = True
                for event in events:  # ends when closed, on shutdown, or when the island joined again
                    if not self.readers.hand(self.on_request if isinstance(event, RoundRequest) else self.on_version, event):
                        return
            except SynchronizerError as err:
                if self._stop.is_set():
                    return
                log.warning("island %d: subscription refused (%s): %s", self.island, err.reason, err)
            except Exception:  # a callback failed: report it and keep the subscription alive
                log.exception("island %d: subscription failed", self.island)
            self._stop.wait(REOPEN_DELAY)
