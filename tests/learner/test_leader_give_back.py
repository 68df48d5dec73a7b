"""What an island leader gives back to a restarted synchronizer of a fragment no rank holds whole
(FSDP): the island gathers it at a step boundary when the leader asks, the next heartbeat offers
it, once per recovery, and the whole copy is gone once the offer is answered; and how an island
whose copy left the published value (summed steps) gets it whole again to give back."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.config import ScheduleConfig
from lightning_diloco.core.downlink import PublishedChain
from lightning_diloco.core.fragments import DENSE, TensorSpec, build_layout
from lightning_diloco.learner.collective import Collective
from lightning_diloco.learner.fragment import IslandFragment
from lightning_diloco.learner.inbox import Inbox
from lightning_diloco.learner.leader import LeaderSync, sync_pool
from lightning_diloco.learner.shards import IslandShards


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


class Publisher:
    """The link of a synchronizer publishing fragment 0 on an int4 downlink: its pulls answer the
    published value (what a restarted one's digest check takes back), counted; they wait until
    ``answering`` is set (the test decides which version they see)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.chain = PublishedChain(value, 0, get_codec("int4"), depth=8)
        self.generator = torch.Generator().manual_seed(0)
        self.pulls = 0
        self.answering = threading.Event()

    def publish(self) -> list:
        """The next version; returns the events a subscriber holding the one before is sent."""
        have = self.chain.version
        self.chain.advance(self.chain.value + 0.01 * torch.randn(self.chain.value.shape, generator=self.generator),
                           have + 1)
        return self.chain.updates(0, have)

    def pull(self, fragment):
        assert self.answering.wait(30)
        self.pulls += 1
        return self.chain.version, self.chain.value.clone()

    def leave(self, island):
        pass

    def close(self):
        pass


def test_an_island_whose_inbox_summed_steps_pulls_the_fragment_whole_and_can_give_it_back():
    """The training thread took nothing for 5 versions (more than the inbox keeps apart): their
    steps were summed and would round its copy away from the published value; the leader pulls
    the fragment once, in the background, and a version published after the pull's answer is
    chained onto it, not lost: the island's copy is the published value bit for bit, offered back."""
    numel = 1000
    value = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    param = value.clone()
    shards = IslandShards([param], build_layout([TensorSpec(name="w", shape=(numel,), dtype="float32", role=DENSE)], 1),
                          Collective(), leader=True)
    f = IslandFragment(0, shards, ScheduleConfig(num_fragments=1, apply="mix"), shards.read(0))
    link = Publisher(value)
    leader = LeaderSync(link, island=0, uplink=get_codec("fp32"), feedback=False, layout_hash="", executor=sync_pool(0, 1),
                        progress=lambda: (0, 0.0, 0))
    inbox = Inbox([0], [numel], block_size=64, max_steps=2, on_summed=leader.want_whole)
    leader.inbox = inbox
    try:
        for _ in range(5):
            for event in link.publish():
                inbox.on_version(event)
        assert not inbox.fresh[0].exact
        link.answering.set()
        assert inbox.wait(lambda: inbox.fresh[0].base_version == -1, 30)  # the pull's answer, put
        assert link.pulls == 1  # once for the event, not once per summed step
        for event in link.publish():  # after the pull's answer, before the island takes it
            inbox.on_version(event)
        [arrival] = inbox.take(lambda a: True)
        f.apply(f.take(arrival))
        assert f.version == 6 and torch.equal(f.base, link.chain.value)
        assert f.held() == (6, f.base)
    finally:
        leader.close()
