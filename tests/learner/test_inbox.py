"""The inbox keeps no copy of the global model: deltas stay deltas from the version the island holds."""

from __future__ import annotations

import dataclasses

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import VersionUpdate
from lightning_diloco.learner.inbox import Inbox


def _update(version: int, base: int, values: list[float]) -> VersionUpdate:
    payload = get_codec("fp32").encode(torch.tensor(values))
    return VersionUpdate(fragment=0, version=version, base_version=base, round=version, codec="fp32", payload=payload,
                         included=False)


def test_deltas_not_yet_taken_are_kept_in_order_from_the_version_held_and_a_whole_value_starts_over():
    inbox = Inbox([3], [4], block_size=64)
    inbox.on_version(_update(4, 3, [1, 1, 1, 1]))
    inbox.on_version(_update(5, 4, [2, 0, 0, 0]))  # the training thread was busy: one arrival, from version 3
    [a] = inbox.take(lambda a: True)
    assert (a.version, a.base_version) == (5, 3)
    assert [s.tolist() for s in a.steps] == [[1, 1, 1, 1], [2, 0, 0, 0]]
    assert inbox.held() == {0: 5}
    inbox.on_version(_update(6, 5, [1, 0, 0, 0]))
    inbox.on_version(_update(7, -1, [9, 9, 9, 9]))  # whole (e.g. after a synchronizer restart)
    inbox.on_version(_update(8, 7, [1, 0, 0, 0]))  # onto the whole value: published_8 = published_7 + step_8
    [b] = inbox.take(lambda a: True)
    assert (b.version, b.base_version, [s.tolist() for s in b.steps]) == (8, -1, [[10, 9, 9, 9]])


def test_past_the_synchronizers_history_the_steps_not_yet_taken_are_summed():
    """Memory stays at ``max_steps`` decoded steps per fragment however long the island is busy."""
    inbox = Inbox([0], [4], block_size=64, max_steps=3)
    for v in range(1, 6):
        inbox.on_version(_update(v, v - 1, [v, 0, 0, 0]))
        assert len(inbox.fresh[0].steps) <= 3
    [a] = inbox.take(lambda a: True)
    assert (a.version, a.base_version) == (5, 0)
    assert sum(s[0].item() for s in a.steps) == 15 and len(a.steps) == 2  # (1 + 2 + 3 + 4), then 5
    assert not a.exact  # summed: the island's copy leaves the published value, offered back to no one
    inbox.on_version(_update(6, 5, [1, 0, 0, 0]))
    inbox.on_version(_update(7, 6, [1, 0, 0, 0]))
    [kept_apart] = inbox.take(lambda a: True)
    assert kept_apart.exact  # (not added to that copy: the fragment records that, fragment.py)
    inbox.on_version(_update(8, 7, [1, 0, 0, 0]))
    for v in range(9, 12):
        inbox.on_version(_update(v, v - 1, [1, 0, 0, 0]))
    inbox.on_version(_update(12, -1, [9, 9, 9, 9]))  # sent whole: the published value again
    [whole] = inbox.take(lambda a: True)
    assert whole.exact and whole.base_version == -1


def test_a_delta_from_another_version_than_the_one_received_is_ignored():
    inbox = Inbox([3], [4], block_size=64)
    inbox.on_version(_update(5, 4, [1, 1, 1, 1]))
    assert inbox.take(lambda a: True) == [] and inbox.held() == {0: 3}


def test_a_chain_of_lossy_steps_taken_at_once_lands_on_the_published_value_bit_for_bit():
    """An island several versions behind is sent the steps since, in order (core/downlink.py); the
    inbox keeps them apart, and added to the island's copy one at a time, as the synchronizer
    published them, they give its published value exactly: what a restarted synchronizer takes
    back (synchronizer/version_log.py). Their sum added at once rounds away from it."""
    from lightning_diloco.core.downlink import PublishedChain

    g = torch.Generator().manual_seed(0)
    held = torch.randn(1000, generator=g)
    chain = PublishedChain(held, 0, get_codec("int4"), depth=8)
    value = held
    for v in range(1, 6):
        value = value + 0.01 * torch.randn(1000, generator=g)
        chain.advance(value, v)
    inbox = Inbox([0], [1000], block_size=64, max_steps=8)
    for update in chain.updates(0, 0):
        inbox.on_version(update)
    [a] = inbox.take(lambda a: True)
    assert (a.version, a.base_version, len(a.steps)) == (5, 0, 5)
    island = held
    for step in a.steps:
        island = island + step
    assert torch.equal(island, chain.value)
    assert not torch.equal(held + sum(a.steps), chain.value)  # the sum the inbox used to keep
    eps = torch.finfo(torch.float32).eps * float(held.abs().max())
    assert float((island - value).abs().max()) > 100 * eps  # int4: the published value is not the global one


def test_summed_steps_ask_for_the_fragment_whole_and_the_stream_versions_decide_when_a_pull_is_put():
    """Past ``max_steps`` the inbox calls ``on_summed``; a pulled whole value is put only at the
    newest version received (one behind or ahead of the stream is refused, pulled again: leader.py),
    in place of the arrival not yet taken with its round and ``included``, and a delta after it is
    chained onto it, exactly as onto any whole value."""
    summed: list[int] = []
    inbox = Inbox([0], [4], block_size=64, max_steps=2, on_summed=summed.append)
    for v in range(1, 4):
        inbox.on_version(dataclasses.replace(_update(v, v - 1, [v, 0, 0, 0]), included=v == 2))
    assert summed == [0] and not inbox.fresh[0].exact and inbox.wants_whole() == {0}
    whole = torch.tensor([6.0, 5, 5, 5])
    assert not inbox.put_pulled(0, 2, whole)  # behind the stream: version 3 is already chained
    assert not inbox.put_pulled(0, 4, whole)  # ahead: version 4's round is not known yet
    assert not inbox.fresh[0].exact
    assert inbox.put_pulled(0, 3, whole)
    assert inbox.wants_whole() == set()
    inbox.on_version(_update(4, 3, [1, 0, 0, 0]))  # came after the pull's answer: chained, not lost
    [a] = inbox.take(lambda a: True)
    assert (a.version, a.round, a.base_version, a.included, a.exact) == (4, 4, -1, True, True)
    assert a.steps[0].tolist() == [7, 5, 5, 5]
    assert inbox.put_pulled(0, 4, whole + 1)  # the version taken, whole again (the island keeps its progress)
    [b] = inbox.take(lambda a: True)
    assert (b.version, b.round, b.base_version, b.included) == (4, -1, -1, False)
