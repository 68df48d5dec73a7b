"""What the synchronizer sent an island, held until the training thread takes it (thread-safe).

The subscription's reader threads put new global versions (as the delta from the version the
island holds, or whole) and round requests in; the island leader takes them at step boundaries.
Only the newest version of each fragment is taken: an island that was busy applies the latest once
and skips the ones in between. The steps received meanwhile are kept apart, in order, and added to
the island's base one by one (:class:`Arrival`), so that its copy is the published value bit for
bit and can be given back to a restarted synchronizer (synchronizer/version_log.py); past
``max_steps`` of them they are summed, and the leader pulls the fragment whole
(:meth:`Inbox.put_pulled`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_diloco.core.codecs import DEFAULT_DENSITY, get_codec, payload_size
from lightning_diloco.core.protocol import RoundRequest, VersionUpdate
from lightning_diloco.learner.clock import SYSTEM_CLOCK, Clock

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class Arrival:
    """A new global version as the island takes it: the :class:`VersionUpdate`s received since the
    version the island holds, decoded (or the full value)."""

    fragment: int
    version: int
    round: int
    """The round that produced this version (-1: none known, e.g. a pulled or seeded value)."""
    steps: tuple[torch.Tensor, ...]
    """With ``base_version`` -1, one tensor: the full global fragment. Otherwise the whole
    fragment's changes from ``base_version`` (the version the island holds) to ``version``, in the
    order they were published, to be added to the island's base one at a time: the synchronizer
    publishes published_v = published_{v-1} + step_v (core/downlink.py), and in fp32
    (base + s1) + s2 is not base + (s1 + s2), so an island that added their sum held a value
    that was not the published one, nor was any version built on it, and gave nothing back
    after a synchronizer's restart. Never modified in place."""
    base_version: int
    included: bool
    """A contribution of this island was merged since the version it held before."""
    exact: bool = True
    """False: more than the inbox keeps apart came before the island took them, and were summed:
    added to the base, they round away from the published value (its copy is not the version it
    names, and is not offered back, until the fragment comes whole: the leader pulls it at once,
    :meth:`Inbox.put_pulled`)."""


class Inbox:
    """Holds no copy of the global model: a version arriving as a delta stays a delta until the
    island applies it to its own base (each rank to its part), so an island's leader needs no
    whole model beside its parameters (+56 MB of peak memory on an FSDP2 island's
    leader, the global model it kept as the base of the next delta)."""

    def __init__(self, versions: list[int], numels: list[int], block_size: int,
                 sparse_density: float = DEFAULT_DENSITY, clock: Clock = SYSTEM_CLOCK, max_steps: int = 4,
                 on_summed: Callable[[int], None] = lambda p: None) -> None:
        """``clock``: what :meth:`wait` waits on (the island's). ``max_steps``: the most steps of
        one fragment kept apart until the island takes them (the synchronizer's ``history``, S:
        a reopened stream brings at most S - 1), each a decoded fp32 copy of the fragment; past
        it they are summed, as they all were before (memory stays at S copies per fragment), and
        the island's copy rounds away from the published value until the fragment comes whole:
        ``on_summed(p)`` is called then (on the reader thread, outside the lock), and the leader
        pulls fragment p whole (leader.py) and puts it here (:meth:`put_pulled`)."""
        assert max_steps >= 1, f"{max_steps=}"
        self.block_size, self.sparse_density, self.numels, self.clock = block_size, sparse_density, numels, clock
        self.max_steps, self.on_summed = max_steps, on_summed
        self.summed: set[int] = set()
        """Fragments whose steps were summed and no whole value came since: the island's copy is,
        or will be once it takes them, off the published value (:meth:`wants_whole`)."""
        self.cond = threading.Condition()
        self.received = dict(enumerate(versions))  # the newest version known per fragment
        self.fresh: dict[int, Arrival] = {}
        self.requests: dict[int, RoundRequest] = {}
        self.reconnects = 0
        self.bytes_received = 0
        self.stopping = False
        """Set by :meth:`stop`: every wait returns at once."""

    # ---- reader threads ----------------------------------------------------------------------

    def held(self) -> dict[int, int]:
        """The version of each fragment received so far: what a reopened stream builds on."""
        with self.cond:
            return dict(self.received)

    def on_version(self, event: VersionUpdate) -> None:
        """A new version from the subscription."""
        p = event.fragment
        with self.cond:
            have = self.received[p]
        update = get_codec(event.codec, self.block_size, self.sparse_density).decode(event.payload, self.numels[p])
        if event.base_version not in (-1, have):  # cannot happen on one stream; a reopened one says its base
            log.warning("fragment %d: version %d came as a delta against %d, but this island holds %d; ignored",
                        p, event.version, event.base_version, have)
            return
        arrival = Arrival(fragment=p, version=event.version, round=event.round, steps=(update,),
                          base_version=event.base_version if event.base_version == -1 else have, included=event.included)
        self.put(arrival, payload_bytes=payload_size(event.payload))

    def put(self, arrival: Arrival, payload_bytes: int = 0) -> None:
        """Make ``arrival`` the newest known version of its fragment: a delta is chained onto the
        one not yet taken (the island holds the version before both)."""
        summed = False
        with self.cond:
            self.bytes_received += payload_bytes
            old = self.fresh.get(arrival.fragment)
            if arrival.base_version == -1:
                self.summed.discard(arrival.fragment)  # sent whole: the published value again
            if old is not None:
                if arrival.base_version != -1:  # chain it onto what waits: still against the island's version
                    steps, exact = self._chained(old, arrival)
                    summed = not exact
                    arrival = dataclasses.replace(arrival, steps=steps, base_version=old.base_version,
                                                  exact=exact and old.exact and arrival.exact)
                if old.included:  # keep the news that our work is in
                    arrival = dataclasses.replace(arrival, included=True)
            if summed:
                self.summed.add(arrival.fragment)
            self.received[arrival.fragment] = arrival.version
            self.fresh[arrival.fragment] = arrival
            self.cond.notify_all()
        if summed:
            self.on_summed(arrival.fragment)

    def ask_whole(self, fragment: int) -> None:
        """The island's copy of ``fragment`` is off the published value already (it resumed from a
        checkpoint that took summed steps, IslandFragment.exact False): wanted whole, as after
        steps summed here."""
        with self.cond:
            self.summed.add(fragment)
        self.on_summed(fragment)

    def wants_whole(self) -> set[int]:
        """The fragments a whole value would bring back to the published one (:attr:`summed`)."""
        with self.cond:
            return set(self.summed)

    def put_pulled(self, fragment: int, version: int, value: torch.Tensor) -> bool:
        """(The leader's pool.) Put the whole ``value`` of ``fragment`` at ``version``, as the
        synchronizer's pull answered, so that the island's copy is its published value again
        after its steps were summed (:meth:`_chained`); returns whether it was put.

        Under the lock, the stream's version numbers decide, so that no step is lost or applied
        twice, whichever of the pull and the subscription comes first:

        - ``version`` below the newest received: a delta came after the pull read the value and is
          already chained onto the steps not yet taken (perhaps summed with them): not put; the
          leader pulls again.
        - above it: the stream has not brought that version yet, nor its round and whether this
          island's contribution is in it (what ends a send in flight): not put either; pulled
          again, the stream's events up to it are in by then.
        - equal: put as a whole arrival (base_version -1, exact), in place of the one not yet
          taken (its round and ``included`` kept: the same version), or, that one taken, as the
          version the island holds again, whole (its apply keeps the island's progress since:
          fragment.py). Every later delta is chained onto it as onto any whole value (:meth:`put`).
        """
        with self.cond:
            if version != self.received[fragment]:
                return False
            old = self.fresh.get(fragment)
            whole = Arrival(fragment=fragment, version=version, round=-1 if old is None else old.round, steps=(value,),
                            base_version=-1, included=old is not None and old.included)
            self.fresh[fragment] = whole
            self.summed.discard(fragment)
            self.cond.notify_all()
            return True

    def _chained(self, old: Arrival, new: Arrival) -> tuple[tuple[torch.Tensor, ...], bool]:
        """The steps of ``old`` followed by ``new``'s (one delta step), and whether adding them to
        the island's base still lands on the published value (False once summed)."""
        if old.base_version == -1:  # published_v = published_{v-1} + step_v: the synchronizer's own sum
            return (old.steps[0] + new.steps[0],), True
        if len(old.steps) < self.max_steps:
            return old.steps + new.steps, True
        summed = old.steps[0].clone()  # memory stays bounded; the island's copy leaves the published value
        for step in old.steps[1:] + new.steps:
            summed.add_(step)
        log.info("fragment %d: more than %d steps came before the island took one: summed (its copy of version %d "
                 "rounds away from the published value until the fragment comes whole: pulled)",
                 new.fragment, self.max_steps, new.version)
        return (summed,), False

    def on_request(self, request: RoundRequest) -> None:
        with self.cond:
            old = self.requests.get(request.fragment)
            if old is None or old.round < request.round:
                self.requests[request.fragment] = request
                self.cond.notify_all()

    def on_reconnect(self) -> None:
        with self.cond:
            self.reconnects += 1
            self.cond.notify_all()

    def stop(self) -> None:
        """The island is stopping (SIGTERM): end the wait in progress and every later one at once.
        Safe in a signal handler: the lock is reentrant, and is held by other threads only briefly."""
        self.stopping = True
        with self.cond:
            self.cond.notify_all()

    def poke(self) -> None:
        """Wake whoever waits on the inbox (something it waits for changed elsewhere)."""
        with self.cond:
            self.cond.notify_all()

    # ---- the training thread -------------------------------------------------------------------

    def take_requests(self) -> dict[int, RoundRequest]:
        with self.cond:
            out, self.requests = self.requests, {}
            return out

    def take(self, ready: Callable[[Arrival], bool]) -> list[Arrival]:
        """Remove and return the fresh arrivals for which ``ready`` holds, by fragment."""
        with self.cond:
            out = [a for _, a in sorted(self.fresh.items()) if ready(a)]
            for a in out:
                del self.fresh[a.fragment]
            return out

    def wait(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Block until ``condition()`` (checked under the lock) holds, ``timeout`` s pass or the
        island is stopping (:meth:`stop`); returns ``condition()``."""
        done = False

        def ready() -> bool:
            nonlocal done
            done = condition()
            return done or self.stopping

        self.clock.wait(self.cond, ready, timeout)
        return done
