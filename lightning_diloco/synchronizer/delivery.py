"""What one island's subscription carries: round requests, and every new global version of each
fragment as deltas from the version that island last received (rounds.py ``publish``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from lightning_diloco.core.protocol import RoundRequest, VersionUpdate
from lightning_diloco.synchronizer.membership import Membership
from lightning_diloco.synchronizer.rounds import FragmentRounds


def island_events(island: int, subscription: int, delivered: dict[int, int], membership: Membership,
                  rounds: Mapping[int, FragmentRounds], count_bytes: Callable[[int], None],
                  active: Callable[[], bool], tick: float, clock: Callable[[], float]) -> Iterator[RoundRequest | VersionUpdate]:
    """Events for ``island`` until ``active()`` turns False or the island subscribes again or
    rejoins (``subscription`` is no longer its current one). ``delivered``: fragment -> the
    version the island holds, updated as versions go out; ``count_bytes`` gets each payload's size;
    ``clock()``: monotonic seconds (a request goes out once its round is due on the run's clock)."""
    changed = membership.changed
    while active():
        with changed:
            if not membership.is_current(island, subscription):
                return
            requests = membership.take_requests(island, clock())
            behind = [p for p, r in rounds.items() if r.frag is not None and r.frag.version != delivered[p]]
            if not requests and not behind:
                changed.wait(tick)
                continue
        yield from requests
        for p in behind:
            with rounds[p].cond:
                updates = rounds[p].publish(island, delivered[p])
            for update in updates:
                count_bytes(update.payload.numel())  # type: ignore[union-attr]  # published versions hold tensors; bytes only off the wire
                delivered[p] = update.version
                yield update
