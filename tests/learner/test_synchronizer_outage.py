"""The synchronizer goes away mid-run: training neither stops nor waits, and resyncs after."""

from __future__ import annotations

import time

import torch
from lightning.pytorch.callbacks import Callback

import lightning_diloco  # noqa: F401
from lightning_diloco import DecoupledDiLoCoStrategy
from lightning_diloco.core.config import CodecConfig, RunConfig, ScheduleConfig
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.learner.models import TinyRegressor, loader, regression_data, trainer


class Outage(Callback):
    """Stops the synchronizer after step ``down`` and restarts it from its checkpoint after ``up``."""

    def __init__(self, servers, make, down, up, step_seconds):
        self.servers, self.make, self.down, self.up, self.step_seconds = servers, make, down, up, step_seconds
        self.applied_before = self.applied_at_restart = None
        self.step_times: list[float] = []
        self._last = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.step_seconds)  # a step with a real duration
        now = time.perf_counter()
        if self._last is not None:
            self.step_times.append(now - self._last)
        self._last = now
        step = trainer.strategy.learner.step
        if step == self.down:
            self.applied_before = trainer.strategy.learner.counters["applied"]
            self.servers[-1].stop(grace=0)
        if step == self.up:
            self.applied_at_restart = trainer.strategy.learner.counters["applied"]
            self.servers.append(self.make())


def test_training_continues_through_a_synchronizer_restart_and_resyncs(tmp_path):
    config = RunConfig(schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1), codec=CodecConfig(uplink="fp32", downlink="fp32"))
    servers = [SynchronizerServer(Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, checkpoint_every=1))).start()]
    port = servers[0].port

    def make():
        return SynchronizerServer(Synchronizer(config, SynchronizerSettings(checkpoint_dir=tmp_path, checkpoint_every=1)), port=port).start()

    outage = Outage(servers, make, down=20, up=40, step_seconds=0.03)
    model = TinyRegressor()
    strategy = DecoupledDiLoCoStrategy(synchronizer=servers[0].address)
    try:
        trainer(strategy, max_epochs=6, callbacks=[outage]).fit(model, loader(regression_data()))
        final_global = [servers[-1].service.pull(p)[1] for p in range(2)]
    finally:
        for s in servers:
            s.stop(grace=0)
    m = strategy.final_metrics
    assert len(model.losses) == 96  # every step ran
    assert outage.applied_before >= 3
    assert m["diloco/syncs_applied"] > outage.applied_at_restart + 5  # synced again after the restart
    # the loop never waited for the synchronizer: the sync hook's own time stays far below a step
    assert m["diloco/blocked_s"] < 0.5, m["diloco/blocked_s"]
    assert max(outage.step_times) < 0.03 + 0.5
    # it ended on the global model of the restarted synchronizer
    learner_view = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert learner_view.numel() == sum(t.numel() for t in final_global)


class ShardReturns(Callback):
    """Starts the absent shard (from its checkpoint) after step ``up``; notes fragment 0's
    version meanwhile."""

    def __init__(self, make, up):
        self.make, self.up, self.server = make, up, None
        self.versions_while_away: list[int] = []
        self.last_versions: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.02)  # a step with a real duration
        learner = trainer.strategy.learner
        if learner.step < self.up:
            self.versions_while_away.append(learner.fragments[0].version)
            assert learner.fragments[1].version == -1  # no global value of the absent shard's fragment
        if learner.step == self.up:
            self.server = self.make()
            # the island finds it back within a few reconnect backoffs; how soon depends on the load
            # (so wait for that, bounded), then trains on and contributes to it
            deadline = time.monotonic() + 60
            while learner.inbox.held()[1] < 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        self.last_versions = learner.versions


def test_with_one_shard_dead_an_island_joins_the_live_shard_trains_and_takes_the_other_back(tmp_path):
    """Issue 21: with one of two shards dead, every join failed (half-registering the island on
    the live one). Now the island joins the live shard and syncs its fragment, trains the other
    locally, and joins the dead shard once it is back from its checkpoint."""
    config = RunConfig(schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1),
                       codec=CodecConfig(uplink="fp32", downlink="fp32"))

    def shard(index, port=0):
        service = Synchronizer(config, SynchronizerSettings(shard=index, num_shards=2, checkpoint_dir=tmp_path / f"shard{index}", checkpoint_every=1))
        return SynchronizerServer(service, port=port).start()

    shards = [shard(0), shard(1)]
    addresses = ",".join(s.address for s in shards)
    returned = None
    try:
        # a first island seeds both shards; then shard 1 dies
        trainer(DecoupledDiLoCoStrategy(synchronizer=addresses), max_epochs=1).fit(TinyRegressor(), loader(regression_data()))
        port1 = shards[1].port
        shards[1].stop(grace=0)
        checkpointed = Synchronizer(config, SynchronizerSettings(shard=1, num_shards=2, checkpoint_dir=tmp_path / "shard1"))
        version1_at_death = checkpointed.versions()[1]
        checkpointed.shutdown()  # the directory is the returning shard's
        version0_at_start = shards[0].service.versions()[0]

        returns = ShardReturns(lambda: shard(1, port1), up=40)
        model = TinyRegressor()
        strategy = DecoupledDiLoCoStrategy(synchronizer=addresses)
        trainer(strategy, max_epochs=6, callbacks=[returns]).fit(model, loader(regression_data()))
        returned = returns.server
        assert len(model.losses) == 96  # every step ran
        # fragment 0 synced while shard 1 was away
        assert max(returns.versions_while_away) > version0_at_start
        assert shards[0].service.versions()[0] > version0_at_start
        # shard 1 came back: the island took its version and contributed to it again
        assert returns.last_versions[1] > version1_at_death
        assert returned.service.versions()[1] > version1_at_death
    finally:
        for s in [*shards, returned]:
            if s is not None:
                s.stop(grace=0)
