"""What the synchronizer sent an island, held until the training thread takes it (thread-safe).

The subscription's reader threads put new global versions (reconstructed here from the delta
against the last version received) and round requests in; the island leader takes them at step
boundaries. Only the newest version of each fragment is kept: an island that was busy applies the
latest and skips the ones in between.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import RoundRequest, VersionUpdate

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class Arrival:
    """A new global version as the island takes it: the :class:`VersionUpdate` decoded into the
    full value against the version held before."""

    fragment: int
    version: int
    round: int
    """The round that produced this version (-1: none known, e.g. a pulled or seeded value)."""
    value: torch.Tensor
    """The full global fragment: never modified in place."""
    included: bool
    """A contribution of this island was merged since the version it held before."""


class Inbox:
    def __init__(self, versions: list[int], values: list[torch.Tensor], block_size: int) -> None:
        self.block_size = block_size
        self.cond = threading.Condition()
        self.received = {p: (v, x) for p, (v, x) in enumerate(zip(versions, values))}  # newest known per fragment
        self.fresh: dict[int, Arrival] = {}
        self.requests: dict[int, RoundRequest] = {}
        self.reconnects = 0
        self.bytes_received = 0

    # ---- reader threads ----------------------------------------------------------------------

    def held(self) -> dict[int, int]:
        """The version of each fragment received so far: what a reopened stream builds on."""
        with self.cond:
            return {p: v for p, (v, _) in self.received.items()}

    def on_version(self, event: VersionUpdate) -> None:
        """A new version from the subscription."""
        p = event.fragment
        with self.cond:
            have, base = self.received[p]
        numel = base.numel()
        update = get_codec(event.codec, self.block_size).decode(event.payload, numel)
        if event.base_version == -1:
            value = update
        elif event.base_version == have:
            value = base + update
        else:  # cannot happen on one stream; a reopened one says which version it builds on
            log.warning("fragment %d: version %d came as a delta against %d, but this island holds %d; ignored",
                        p, event.version, event.base_version, have)
            return
        arrival = Arrival(fragment=p, version=event.version, round=event.round, value=value, included=event.included)
        self.put(arrival, payload_bytes=len(event.payload))

    def put(self, arrival: Arrival, payload_bytes: int = 0) -> None:
        """Make ``arrival`` the newest known value of its fragment (pulled values come this way too)."""
        with self.cond:
            self.bytes_received += payload_bytes
            old = self.fresh.get(arrival.fragment)
            if old is not None and old.included:  # keep the news that our work is in
                arrival = dataclasses.replace(arrival, included=True)
            self.received[arrival.fragment] = (arrival.version, arrival.value)
            self.fresh[arrival.fragment] = arrival
            self.cond.notify_all()

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
        """Block until ``condition()`` (checked under the lock) holds or ``timeout`` s pass."""
        with self.cond:
            return self.cond.wait_for(condition, timeout)
