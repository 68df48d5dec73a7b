"""What one island's subscription carries: round requests, and every new global version of each
fragment as deltas from the version that island last received (rounds.py ``publish``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from lightning_diloco.core.protocol import RoundRequest, VersionUpdate
from lightning_diloco.synchronizer.fragment import Fragment, Shared


def island_events(island: int, subscription: int, delivered: dict[int, int], fragments: Mapping[int, Fragment],
                  shared: Shared, active: Callable[[], bool], tick: float) -> Iterator[RoundRequest | VersionUpdate]:
    """Events for ``island`` until ``active()`` turns False or the island subscribes again or
    rejoins (``subscription`` is no longer its current one). ``delivered``: fragment -> the
    version the island holds, updated as versions go out; the tally counts each payload's bytes; a request goes out once its
    round is due on the run's clock (``shared.clock``)."""
    membership, changed = shared.membership, shared.membership.changed
    while active():
        with changed:
            if not membership.is_current(island, subscription):
                return
            requests = membership.take_requests(island, shared.clock())
            behind = [p for p, f in fragments.items() if f.state is not None and f.state.version != delivered[p]]
            if not requests and not behind:
                changed.wait(tick)
                continue
        yield from requests
        for p in behind:
            for update in fragments[p].updates_for(island, delivered[p]):
                shared.tally.add_bytes(sent=update.payload.numel())  # type: ignore[union-attr]  # published versions hold tensors; bytes only off the wire
                delivered[p] = update.version
                yield update
