"""Addresses that are not one run's shards are refused at join, naming what differs."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.transport.client import SynchronizerClient, SynchronizerError
from tests.helpers import SPECS, run_config


def _servers(configs_and_shards):
    return [SynchronizerServer(Synchronizer(c, SynchronizerSettings(shard=s, num_shards=n))).start() for c, s, n in configs_and_shards]


@pytest.mark.parametrize("case", ["different_H", "two_shard_zeros", "shard_count"])
def test_shards_that_are_not_one_runs_are_refused_naming_the_difference(case):
    config = run_config(num_fragments=2)
    other_h = dataclasses.replace(config, schedule=dataclasses.replace(config.schedule, sync_every=8))
    layouts = {
        "different_H": [(config, 0, 2), (other_h, 1, 2)],
        "two_shard_zeros": [(config, 0, 2), (config, 0, 2)],
        "shard_count": [(config, 0, 2), (config, 1, 3)],
    }[case]
    servers = _servers(layouts)
    client = SynchronizerClient([s.address for s in servers], max_retries=0)
    try:
        with pytest.raises(SynchronizerError) as err:
            client.join(0, 1, SPECS)
        assert err.value.reason == "shard_mismatch"
        expected = {"different_H": "schedule.sync_every differs", "two_shard_zeros": "is shard 0, but it is address 1",
                    "shard_count": "count other numbers of shards"}[case]
        assert expected in str(err.value), str(err.value)
    finally:
        client.close()
        for s in servers:
            s.stop(grace=0)
