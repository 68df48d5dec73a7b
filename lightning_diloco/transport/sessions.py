"""The island's session with each shard of a run: joining, joining again, and absence.

A join goes to every shard and succeeds when at least one answers: the shards that did not are
*absent* (no session), and the client's calls for their fragments fail at once instead of
waiting out the retries, while the island trains those fragments locally. A shard that restarted
(or that forgot this island's session, or is back after being absent) is joined again
(:meth:`ShardSessions.rejoin`), one join for every caller that noticed; a shard that stops
answering later is marked absent again. Every reply is checked to come from a shard of the same
run (shard_check.py).

Every join presents the session this client last had with the shard (none before its first):
a shard refuses a join as an island that another client is running as (``island_running``),
and this is how it tells the running client joining again from a second process.

:class:`ShardSessions` is held by an island's link (transport/island_link.py), which gives it
the transport its joins go through; the subscription reads a shard's session from it as a
:class:`ShardSession`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from lightning_diloco.core.protocol import JoinInfo
from lightning_diloco.reasons import Reason, SynchronizerError
from lightning_diloco.transport.shard_check import shard_mismatch
from lightning_diloco.transport.shard_transport import JoinRequest, ShardJoin, ShardTransport, Unanswered

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardSession:
    """The island's session with one shard, as of one moment."""

    session: str
    """What a call to the shard presents ("": absent, not joined or stopped answering)."""
    joins: int
    """Successful joins of the shard so far: which session a failing call was made with."""
    incarnation: str
    """Which process of the shard issued the session (a restart reissues version numbers)."""


class ShardSessions:
    """Per shard: this island's session, how many joins made it, and which process issued it.
    ``transport``: how the shards are reached."""

    def __init__(self, transport: ShardTransport) -> None:
        self.transport, self.addresses = transport, list(transport.addresses)
        self.request: JoinRequest | None = None  # the island's join, repeated by rejoin(); None: not joined (or left)
        self._join_lock = threading.Lock()  # one join at a time: see rejoin()
        self._replies: dict[int, ShardJoin] = {}  # per shard, its last join's answer
        num_shards = len(self.addresses)
        # per shard: successful joins so far (which session a failing call was made with), the
        # session ("": absent, not joined or stopped answering) and which process that was
        self.joins = [0] * num_shards
        self.sessions = [""] * num_shards
        self.incarnations = [""] * num_shards
        self._last_sessions = [""] * num_shards  # per shard, kept while it is absent: presented at the next join

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def of(self, shard: int) -> ShardSession:
        return ShardSession(session=self.sessions[shard], joins=self.joins[shard], incarnation=self.incarnations[shard])

    def absent(self, shard: int) -> bool:
        """The shard is not joined (it did not answer the join, or stopped answering since)."""
        return not self.sessions[shard]

    def join(self, request: JoinRequest) -> JoinInfo:
        """Join the shards that answer, as ``request`` says; raise when none does. On success the
        request is the island's: :meth:`rejoin` repeats it."""
        with self._join_lock:
            info = self._join_all(request)
            self.request = request
            return info

    def leave(self) -> list[str]:
        """Forget the island's join (no rejoin is under way, and none starts after this); the
        sessions it had, per shard, to leave with."""
        with self._join_lock:
            self.request = None
            return list(self.sessions)

    def rejoin(self, shard: int, joins: int) -> None:
        """Join ``shard`` again after it forgot this island's session (it restarted, or the
        island joined elsewhere), or once it is back after being absent. ``joins``:
        ``self.joins[shard]`` when the refused call was made.

        Single-flight: the push pool, the heartbeat and the subscription reader notice a restart
        at about the same time, and each join issues a new session and ends the subscription of
        the one before, so rejoins that each caller made would undo each other. The first caller
        joins; the others wait for it and return, since the count moved past what they saw.
        """
        with self._join_lock:
            if self.joins[shard] != joins or self.request is None:
                return
            self._join_shard(shard, self.request)
            self._check_shards()
            log.info("joined shard %d at %s again", shard, self.addresses[shard])

    def mark_absent(self, shard: int, joins: int) -> None:
        """Stop calling a shard that no longer answers, unless it was joined again meanwhile."""
        with self._join_lock:
            if self.joins[shard] == joins and self.sessions[shard]:
                self.sessions[shard] = ""
                log.warning("shard %d at %s stopped answering: its fragments train locally until it is back",
                            shard, self.addresses[shard])

    def _join_shard(self, shard: int, request: JoinRequest) -> ShardJoin:
        """(With ``_join_lock`` held.)"""
        reply = self.transport.join(shard, request, self._last_sessions[shard])
        self._replies[shard] = reply
        self.sessions[shard], self.incarnations[shard] = reply.info.session, reply.info.incarnation
        self._last_sessions[shard] = reply.info.session
        self.joins[shard] += 1
        return reply

    def _check_shards(self) -> None:
        mismatch = shard_mismatch(self.addresses, self._replies)
        if mismatch:
            raise SynchronizerError(None, Reason.SHARD_MISMATCH, f"the {self.num_shards} addresses are not the shards of one run: {mismatch}")

    def _join_all(self, request: JoinRequest) -> JoinInfo:
        """(With ``_join_lock`` held.) Join the shards that answer; raise when none does."""
        unreachable: dict[int, Exception] = {}
        for shard in range(self.num_shards):
            try:
                self._join_shard(shard, request)
            except (Unanswered, TimeoutError) as err:
                unreachable[shard] = err
                self.sessions[shard] = ""
        if len(unreachable) == self.num_shards:
            raise unreachable[0]  # nothing joined: retried like any call to an unreachable synchronizer
        self._check_shards()
        if unreachable:
            log.warning("shard(s) %s (%s) not answering: joined the other %d; their fragments train locally until "
                        "they are back", sorted(unreachable), ", ".join(self.addresses[s] for s in sorted(unreachable)),
                        self.num_shards - len(unreachable))
        replies = [self._replies[s].info for s in range(self.num_shards) if s not in unreachable]
        versions: dict[int, int] = {}
        for r in replies:
            versions.update(r.versions)
        # one run seen from every joined shard: each shard's versions, the furthest clock
        return dataclasses.replace(replies[0], versions=versions, run_step=max(r.run_step for r in replies))
