"""What an island leader gives back to a restarted synchronizer of a fragment no rank holds whole
(FSDP): the island gathers it at a step boundary when the leader asks, the next heartbeat offers
it, once per recovery, and the whole copy is gone once the offer is answered."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.learner.leader import LeaderSync, sync_pool


class Synchronizer:
    """The link of a restarted synchronizer: the versions its heartbeats show, the seeds it is offered."""

    def __init__(self) -> None:
        self.versions = {0: -1, 1: 4}
        self.seeds: list[tuple[int, torch.Tensor]] = []
        self.down = False

    def heartbeat(self, island, steps, step_time, schedule_step):
        return SimpleNamespace(versions=dict(self.versions))

    def seed(self, island, fragment, value):
        if self.down:
            raise ConnectionError("unreachable")
        self.seeds.append((fragment, value))
        return True, 7

    def leave(self, island):
        pass

    def close(self):
        pass


def _leader(link: Synchronizer) -> LeaderSync:
    return LeaderSync(link, island=0, uplink=get_codec("fp32"), feedback=False, layout_hash="", executor=sync_pool(0, 1),
                      progress=lambda: (0, 0.0, 0))  # holds nothing whole: every fragment sharded


def test_a_sharded_fragment_is_gathered_when_the_synchronizer_waits_for_it_and_offered_once_per_recovery():
    link = Synchronizer()
    leader = _leader(link)
    try:
        held = {0: 7, 1: 4}  # fragment -> the version the island holds in parts
        assert leader.to_gather(held) is None  # no heartbeat yet: nothing known to wait
        leader._beat()  # fragment 0 waits to be given back
        assert leader.to_gather(held) == 0
        value = torch.arange(4.0)
        leader.hold_gathered(0, 7, value)
        assert leader.to_gather(held) is None  # one whole fragment on the leader at a time
        leader._beat()
        assert len(link.seeds) == 1 and link.seeds[0][0] == 0 and link.seeds[0][1] is value
        assert leader._gathered is None  # answered: the whole copy is dropped
        leader._beat()
        assert leader.to_gather(held) is None and len(link.seeds) == 1  # once per recovery, not at every step
        link.versions[0] = 7  # served again ...
        leader._beat()
        link.versions[0] = -1  # ... until the next restart, which is offered it again
        leader._beat()
        assert leader.to_gather(held) == 0
    finally:
        leader.close()


def test_a_gathered_fragment_no_longer_waited_for_is_dropped_and_an_offer_that_failed_is_made_again():
    link = Synchronizer()
    leader = _leader(link)
    try:
        leader._beat()
        leader.hold_gathered(0, 7, torch.zeros(4))
        link.versions[0] = 7  # another island gave it back meanwhile
        leader._beat()
        assert link.seeds == [] and leader._gathered is None
        link.versions[0], link.down = -1, True
        leader._beat()
        leader.hold_gathered(0, 7, torch.zeros(4))
        leader._beat()  # the seed call failed: not an offer
        assert leader._gathered is None and leader.to_gather({0: 7}) == 0
        link.down = False
        leader.hold_gathered(0, 7, torch.zeros(4))
        leader._beat()
        assert [p for p, _ in link.seeds] == [0]
    finally:
        leader.close()
