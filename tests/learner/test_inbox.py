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
