"""The inbox keeps no copy of the global model: deltas stay deltas from the version the island holds."""

from __future__ import annotations

import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.protocol import VersionUpdate
from lightning_diloco.learner.inbox import Inbox


def _update(version: int, base: int, values: list[float]) -> VersionUpdate:
    payload = get_codec("fp32").encode(torch.tensor(values))
    return VersionUpdate(fragment=0, version=version, base_version=base, round=version, codec="fp32", payload=payload,
                         included=False)


def test_deltas_not_yet_taken_are_summed_from_the_version_held_and_a_whole_value_starts_over():
    inbox = Inbox([3], [4], block_size=64)
    inbox.on_version(_update(4, 3, [1, 1, 1, 1]))
    inbox.on_version(_update(5, 4, [2, 0, 0, 0]))  # the training thread was busy: one arrival, from version 3
    [a] = inbox.take(lambda a: True)
    assert (a.version, a.base_version, a.value.tolist()) == (5, 3, [3, 1, 1, 1])
    assert inbox.held() == {0: 5}
    inbox.on_version(_update(6, 5, [1, 0, 0, 0]))
    inbox.on_version(_update(7, -1, [9, 9, 9, 9]))  # whole (e.g. after a synchronizer restart)
    inbox.on_version(_update(8, 7, [1, 0, 0, 0]))
    [b] = inbox.take(lambda a: True)
    assert (b.version, b.base_version, b.value.tolist()) == (8, -1, [10, 9, 9, 9])


def test_a_delta_from_another_version_than_the_one_received_is_ignored():
    inbox = Inbox([3], [4], block_size=64)
    inbox.on_version(_update(5, 4, [1, 1, 1, 1]))
    assert inbox.take(lambda a: True) == [] and inbox.held() == {0: 3}


def test_a_chain_of_lossy_steps_taken_at_once_lands_on_the_published_value():
    """An island several versions behind is sent the steps since, in order (core/downlink.py);
    the inbox sums them, and the island's copy is the synchronizer's published value but for fp32
    rounding."""
    from lightning_diloco.core.downlink import PublishedChain

    g = torch.Generator().manual_seed(0)
    held = torch.randn(1000, generator=g)
    chain = PublishedChain(held, 0, get_codec("int4"), depth=8)
    value = held
    for v in range(1, 6):
        value = value + 0.01 * torch.randn(1000, generator=g)
        chain.advance(value, v)
    inbox = Inbox([0], [1000], block_size=64)
    for update in chain.updates(0, 0):
        inbox.on_version(update)
    [a] = inbox.take(lambda a: True)
    assert (a.version, a.base_version) == (5, 0)
    eps = torch.finfo(torch.float32).eps * float(held.abs().max())
    assert float((held + a.value - chain.value).abs().max()) <= 4 * eps
    assert float((held + a.value - value).abs().max()) > 100 * eps  # int4: the published value is not the global one
