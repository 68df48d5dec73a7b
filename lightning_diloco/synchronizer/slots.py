"""The slots a call that can last takes on the gRPC server (server.py), so that one island's
credential cannot take what the others need.

Each stream that can last holds one of its island's few slots of its kind (subscriptions,
payload streams, pulls; the operator's exports beside them): 260 subscriptions, or 300 pushes or
seeds sending a byte every 5 s, locked honest islands out, and 300 pulls never read held 1 GB.
Calls that can hold a worker for long (subscriptions, pulls, exports) also take a long-call slot:
they leave ``RESERVE`` workers free for the rest, and subscriptions, which last as long as their
island is connected, leave ``PULL_RESERVE`` of the long-call workers to pulls and exports, each
ended by its deadline (deadlines.py): without a token anyone may join as many islands, and 260
unread subscriptions of made-up islands took every long-call worker, so an honest island's pull
was refused ``busy``. A call that finds no slot is refused ``busy`` at once.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from lightning_diloco.reasons import Reason
from lightning_diloco.synchronizer.requests import Refusal, Tally

RESERVE = 8  # workers kept free of long calls (subscriptions, pulls) for everything else
PULL_RESERVE = 16  # long-call workers subscriptions never take: pulls (2 per island) and exports find one
SUBSCRIPTIONS_PER_ISLAND = 2  # open streams of one island: its current one and the one it replaces
PULLS_PER_ISLAND = 2  # an island pulls one fragment at a time (joining, ending); the second: a retry's overlap
EXPORTS_AT_ONCE = 2  # the operator's export reads one fragment at a time; the second: a retry's overlap
OPERATOR = -1  # the key of the operator's own slots (exports) beside the islands'


class Slots:
    """Each take returns its release (call it once, when the call ends) or raises a busy refusal."""

    def __init__(self, tally: Tally, max_workers: int) -> None:
        self.tally = tally
        self.lock = threading.Lock()
        self.held: Counter[tuple[int, str]] = Counter()  # (island, kind) -> its streams of that kind
        self.workers = max(1, max_workers - RESERVE)  # the long calls' budget
        self.reserved = min(PULL_RESERVE, self.workers // 2)  # of which subscriptions never take these
        self.in_use = self.subscriptions = 0

    def island(self, island: int, kind: str, slots: int) -> Callable[[], None]:
        """One of ``island``'s ``slots`` slots of ``kind``."""
        key = (island, kind)
        with self.lock:
            if self.held[key] >= slots:
                who = "the operator" if island == OPERATOR else f"island {island}"
                raise self.tally.refuse(Reason.BUSY, f"{who} already holds {slots} {kind} streams, the most "
                                        "it may; retry once one has ended (each ends by its deadline)")
            self.held[key] += 1

        def release() -> None:
            with self.lock:
                self.held[key] -= 1
                if not self.held[key]:
                    del self.held[key]

        return release

    def long_call(self, what: str) -> Callable[[], None]:
        """A worker for a long call: a subscription takes one of all but ``reserved``, a pull or
        an export any free one."""
        subscription = what == "subscription"
        with self.lock:
            if self.in_use >= self.workers or (subscription and self.subscriptions >= self.workers - self.reserved):
                share = f"subscriptions may take (all but {self.reserved}, kept for pulls)" if subscription else "long calls"
                raise self.tally.refuse(Reason.BUSY, f"every worker {share} is taken; the {what} is refused, retry later "
                                        "(or start the synchronizer with more --max-workers)")
            self.in_use += 1
            self.subscriptions += subscription

        def release() -> None:
            with self.lock:
                self.in_use -= 1
                self.subscriptions -= subscription

        return release

    def island_long_call(self, island: int, kind: str, slots: int) -> Callable[[], None]:
        """One of ``island``'s slots of ``kind``, then a long-call slot: its own first, so one
        client's calls never take the workers every other island needs; the release of both."""
        own = self.island(island, kind, slots)
        try:
            shared = self.long_call(kind)
        except Refusal:
            own()
            raise

        def release() -> None:
            shared()
            own()

        return release
