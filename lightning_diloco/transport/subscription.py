"""An island's subscription: one long-lived event stream per shard, read on its own thread and
reopened whenever it breaks (rejoining first when the synchronizer restarted, or when the shard
was absent and is back). Events are the synchronizer's round requests and new global versions,
handed to the island's callbacks.

A subscription reads the island's session with each shard from its link's
:class:`~lightning_diloco.transport.sessions.ShardSessions` (:meth:`~ShardSessions.of`, and
:meth:`~ShardSessions.rejoin` when a shard forgot it), and opens its streams through the link's
transport (transport/shard_transport.py, either one); it reads nothing else of the link.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

from lightning_diloco.core.protocol import RoundRequest, VersionUpdate
from lightning_diloco.core.readers import Readers
from lightning_diloco.core.state import shard_of
from lightning_diloco.core.threads import single_threaded_torch
from lightning_diloco.reasons import REJOIN
from lightning_diloco.transport.sessions import ShardSessions
from lightning_diloco.transport.shard_transport import EventStream, Refused, ShardTransport, Unanswered

log = logging.getLogger(__name__)

RESUBSCRIBE_BACKOFF = 1.0  # seconds, the longest wait before a broken subscription is reopened


class Subscription:
    """One island's event streams, one reader thread per shard; reopened whenever they break.

    ``sessions``: the island's sessions with the shards; ``transport``: how their event streams
    are opened (each cancellable); ``closed()``: the link is closed; ``backoff`` and ``rng``: the
    link's retry delays. ``versions()``, ``on_request``, ``on_version``, ``on_reconnect``: the
    island's (:meth:`~lightning_diloco.transport.island_link.IslandLink.subscribe`)."""

    def __init__(self, island: int, sessions: ShardSessions, *, transport: ShardTransport, closed: Callable[[], bool],
                 backoff: float, rng: random.Random, versions: Callable[[], dict[int, int]],
                 on_request: Callable[[RoundRequest], None], on_version: Callable[[VersionUpdate], None],
                 on_reconnect: Callable[[], None]) -> None:
        self.island, self.sessions, self.transport, self.closed = island, sessions, transport, closed
        self.backoff, self.rng = backoff, rng
        self.versions = versions
        self.on_request, self.on_version, self.on_reconnect = on_request, on_version, on_reconnect
        self.readers = Readers(f"island {island}'s subscription")
        self._stop = self.readers.stopping
        self._lock = threading.Lock()
        self._calls: dict[int, EventStream] = {}
        for shard in range(sessions.num_shards):
            self.readers.add(f"diloco-subscription-{island}-{shard}", self._read, shard)

    def start(self) -> Subscription:
        self.readers.start()
        return self

    def close(self) -> None:
        """End the streams and join the reader threads."""
        self.stop()
        self.join()

    def stop(self) -> None:
        """Tell the readers to end, and end the streams they read (without waiting for them).
        Safe to call again, from any thread."""
        self._stop.set()
        with self._lock:
            calls = list(self._calls.values())
        for call in calls:
            call.cancel()

    def join(self) -> list[str]:
        """Wait for the readers to end, at most ``JOIN_TIMEOUT`` (core/readers.py): the names of
        those still inside a callback then, each logged."""
        return self.readers.join()

    def _read(self, shard: int) -> None:
        single_threaded_torch()  # it decodes fragments beside the training loop
        attempt, opened_before, num_shards = 0, False, self.sessions.num_shards
        current = self.sessions.of(shard)
        joins, incarnation = current.joins, current.incarnation
        while not self._stop.is_set() and not self.closed():
            try:
                current = self.sessions.of(shard)
                held = {p: v for p, v in self.versions().items() if shard_of(p, num_shards) == shard}
                if current.incarnation != incarnation:
                    # a restarted synchronizer reissues the version numbers past its last checkpoint
                    # with other contents: what this island holds is no base for its deltas
                    held, incarnation = {}, current.incarnation
                joins = current.joins
                call = self.transport.events(shard, self.island, held, current.session)
                with self._lock:
                    if self._stop.is_set():
                        call.cancel()
                        return
                    self._calls[shard] = call
                if opened_before and not self.readers.hand(self.on_reconnect):
                    return
                opened_before = True
                if self._consume(call):
                    attempt = 0  # it worked for a while: back off from the start again
            except Refused as err:
                if self._stop.is_set():
                    return
                if err.reason in REJOIN:
                    try:
                        self.sessions.rejoin(shard, joins)  # also how an absent shard is joined once it is back
                        continue
                    except (Refused, Unanswered, TimeoutError):
                        pass
                    except ValueError:  # the transport closed while it joined (gRPC's "closed channel")
                        if self.closed():
                            return
                        raise
                else:
                    log.warning("island %d: subscription to shard %d refused (%s): %s", self.island, shard, err.label,
                                err.details)
            except (Unanswered, TimeoutError):  # away, or ended (a cancel, a restart): reopened
                if self._stop.is_set():
                    return
            except Exception:  # a callback failed: report it and keep the stream alive
                if self._stop.is_set():  # or the client closed its channels under the call
                    return
                log.exception("island %d: subscription to shard %d failed", self.island, shard)
            # at most a second between tries: an island whose stream is down gets no new versions,
            # so its contributions age while the synchronizer is back (a restart is seconds long)
            delay = min(RESUBSCRIBE_BACKOFF, self.backoff * 2 ** min(attempt, 30)) * (0.5 + self.rng.random() / 2)
            attempt += 1
            self._stop.wait(delay)

    def _consume(self, stream: EventStream) -> bool:
        """Hand the stream's events to the callbacks until it ends, or until the readers stop (then
        the next event is handed to nobody); True if any arrived."""
        any_event = False
        for event in stream:
            any_event = True
            if not self.readers.hand(self.on_request if isinstance(event, RoundRequest) else self.on_version, event):
                break
        return any_event
