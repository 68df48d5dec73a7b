"""Fabric(strategy="decoupled_diloco"): one island in-process, two island processes on one
synchronizer, an island of two DDP processes, fabric.save / fabric.load resuming the island, its
hyperparameters, a Trainer strategy given to Fabric, and an island process stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import lightning_diloco
from lightning_diloco import DecoupledDiLoCoFabricStrategy
from lightning_diloco.core.config import CodecConfig, MergeConfig, RunConfig, ScheduleConfig
from lightning_diloco.learner.sigterm import EXIT_ON_SIGTERM
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.helpers import holds_final_global_model
from tests.learner.fabric_island import train

SCRIPT = Path(__file__).with_name("fabric_island.py")
SETTINGS = dict(sync_every=4, num_fragments=2, uplink_codec="fp32", downlink_codec="fp32")


def _fabric(strategy) -> Fabric:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=1)
    fabric.launch()
    return fabric


@pytest.fixture(autouse=True)
def _no_run_from_environment(monkeypatch):
    for name in ("DILOCO_SYNCHRONIZER", "DILOCO_ISLAND", "DILOCO_NUM_ISLANDS", "DILOCO_TOKEN"):
        monkeypatch.delenv(name, raising=False)


def test_fabric_by_name_trains_one_island_with_outer_steps_and_ends_on_the_global_model(monkeypatch):
    monkeypatch.setenv("DILOCO_ISLAND", "0")  # the name takes its settings from the environment, as a launcher gives them
    fabric = _fabric("decoupled_diloco")
    strategy = fabric.strategy
    assert isinstance(strategy, DecoupledDiLoCoFabricStrategy)
    model, losses = train(fabric, 3)
    during = strategy.metrics()
    assert during["diloco/syncs_applied"] >= 4 and during["diloco/min_version"] >= 1  # outer steps happened
    service = strategy.embedded
    strategy.teardown()
    # 3 epochs of 16 steps: every fragment sent and merged at least once; the island ends on the global model
    assert losses[-1] < losses[0]
    assert strategy.learner is None and strategy.metrics()["diloco/syncs_sent"] >= during["diloco/syncs_sent"]
    assert holds_final_global_model(list(model.parameters()), service, service.run.config.schedule.num_fragments)


def test_fabric_island_counts_tokens_of_each_batch_and_gives_the_run_wide_data_rank():
    strategy = DecoupledDiLoCoFabricStrategy(synchronizer="localhost:1", island=1, num_islands=2, **SETTINGS)
    fabric = _fabric(strategy)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    # island 1 of 2 (one process) takes every other sample: data rank 1 of 2
    assert [float(b[0][0]) for b in loader] == [1.0, 5.0]  # 4 samples, batches of 2
    assert strategy.diloco.tokens == 4.0  # samples, for a batch without input_ids
    assert lightning_diloco.data_rank(fabric) == (1, 2)
    assert lightning_diloco.data_rank(Fabric(accelerator="cpu", devices=1)) == (0, 1)  # no island: all the data


def test_fabric_island_warns_of_an_iterable_dataset_no_one_split_and_refuses_an_optimizer_without_its_module():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(4.0))

    fabric = _fabric(DecoupledDiLoCoFabricStrategy(synchronizer="localhost:1", island=0, num_islands=2, **SETTINGS))
    with pytest.warns(UserWarning, match="Stream.*every island trains on the same samples"):
        fabric.setup_dataloaders(DataLoader(Stream(), batch_size=2))
    with pytest.raises(RuntimeError, match="set up the model before or with its optimizer"):
        fabric.setup_optimizers(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))


def test_fabric_save_and_load_resume_the_island_as_if_never_stopped(tmp_path):
    """Synchronous (tau 0) and fp32, so the run is deterministic: two epochs, saved after each,
    then the second epoch again from the first epoch's checkpoint in a new Fabric, match."""
    settings = dict(SETTINGS, overlap_steps=0, end_with_global_model=False)
    straight = DecoupledDiLoCoFabricStrategy(**settings)
    whole, _ = train(_fabric(straight), 2, save=tmp_path / "straight.ckpt")
    straight.teardown()

    first = DecoupledDiLoCoFabricStrategy(**settings)
    train(_fabric(first), 1, save=tmp_path / "first.ckpt")
    first.teardown()
    saved = torch.load(tmp_path / "first.ckpt", weights_only=True)
    assert saved["decoupled_diloco"]["learner"]["step"] == 16 and saved["decoupled_diloco"]["embedded"] is not None

    resumed = DecoupledDiLoCoFabricStrategy(**settings)
    model, losses = train(_fabric(resumed), 2, seed=123, resume=tmp_path / "first.ckpt")  # another init: all from the checkpoint
    resumed.teardown()
    assert len(losses) == 16  # the second epoch only
    assert resumed.final_metrics["diloco/min_version"] == 8  # 32 steps / H=4 per fragment
    # the counters go on from the checkpoint's, not from 0: 32 steps sent 16 times either way
    assert resumed.final_metrics["diloco/syncs_sent"] == straight.final_metrics["diloco/syncs_sent"] == 16
    for a, b in zip(whole.parameters(), model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fabric_load_rejoins_a_remote_synchronizer_and_the_island_goes_on_from_its_checkpoint(tmp_path):
    """fabric.load after setup: the island joined at setup leaves the run and joins again from
    the checkpoint, over gRPC; its step and counters go on from the saved ones."""
    config = RunConfig(schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=0),
                       codec=CodecConfig(uplink="fp32", downlink="fp32"))
    server = SynchronizerServer(Synchronizer(config)).start()
    try:
        first = DecoupledDiLoCoFabricStrategy(synchronizer=server.address, end_with_global_model=False)
        train(_fabric(first), 1, save=tmp_path / "island.ckpt")
        first.teardown()
        resumed = DecoupledDiLoCoFabricStrategy(synchronizer=server.address, end_with_global_model=False)
        fabric = _fabric(resumed)
        _, losses = train(fabric, 2, resume=tmp_path / "island.ckpt")
        assert resumed.learner.step == 32 and len(losses) == 16
        assert resumed.metrics()["diloco/syncs_sent"] == 16  # 8 before the checkpoint, 8 after
        resumed.teardown()
        status = server.service.status()
    finally:
        server.stop(grace=0)
    assert status.islands[0].left and status.islands[0].accepted == 16, status.islands


def test_fabric_island_hyperparameters_are_the_run_settings_as_the_synchronizer_has_them():
    """What a script logs in one call (fabric.logger.log_hyperparams(...)), as the Trainer
    strategy logs by itself: Fabric's own CSVLogger refuses hyperparameters, so the strategy
    does not log them unasked."""
    strategy = DecoupledDiLoCoFabricStrategy(sync_every=8, uplink_codec="int8")
    before = strategy.hyperparameters()
    assert before["diloco/sync_every"] == 8 and before["diloco/num_fragments"] == 8  # min(24, H), this island's
    train(_fabric(strategy), 1)
    joined = strategy.hyperparameters()
    strategy.teardown()
    assert (joined["diloco/island"], joined["diloco/num_islands"], joined["diloco/synchronizer"]) == (0, 1, "embedded")
    assert joined["diloco/num_fragments"] == 4  # as the synchronizer has it: lowered to the model's 4 tensors
    assert joined["diloco/uplink_codec"] == "int8" and joined["diloco/island_processes"] == 1 and "diloco/outer_lr" in joined


@pytest.mark.parametrize(("trainer_class", "fabric_class", "name"), [
    ("DecoupledDiLoCoStrategy", "DecoupledDiLoCoFabricStrategy", "decoupled_diloco"),
    ("DecoupledDiLoCoFSDPStrategy", "DecoupledDiLoCoFabricFSDPStrategy", "decoupled_diloco_fsdp"),
])
def test_fabric_refuses_a_trainer_strategy_naming_the_fabric_class_and_the_arguments_to_give_it(
        trainer_class, fabric_class, name):
    import lightning.pytorch  # noqa: F401 - a Trainer script's strategy, given to Fabric

    trainer_strategy = getattr(lightning_diloco, trainer_class)(synchronizer="sync:7470", island=1, num_islands=4,
                                                                sync_every=8, uplink_codec="int8")
    with pytest.raises(ValueError) as refused:
        Fabric(strategy=trainer_strategy, accelerator="cpu", devices=1)
    message = str(refused.value)
    assert f"Fabric takes lightning_diloco.{fabric_class}" in message
    written = message.split("Fabric takes lightning_diloco.", 1)[1].split(") with the same arguments", 1)[0] + ")"
    # what the message says to write builds the Fabric strategy with the same settings
    fabric_strategy = eval(written, {fabric_class: getattr(lightning_diloco, fabric_class)})  # noqa: S307
    assert (fabric_strategy.address, fabric_strategy.island, fabric_strategy.num_islands) == ("sync:7470", 1, 4)
    assert fabric_strategy.run_config == trainer_strategy.run_config
    assert f'Fabric(strategy="{name}")' in message


def _island(out, *args, **env):
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out), *args], env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_fabric_island_stopped_by_sigterm_leaves_the_run_and_exits_at_once(tmp_path):
    """A synchronous island (tau 0) of a run of 2 (quorum 2) with the other island never there:
    it waits for its first round, which no quorum will close, up to push_wait (120 s). A Fabric
    script has no SIGTERM handler of its own: the island ends the wait, leaves the run and exits
    143, as a shell reports a SIGTERM."""
    config = RunConfig(schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=0),
                       merge=MergeConfig(min_quorum=2, grace_gamma=0.0), codec=CodecConfig(uplink="fp32", downlink="fp32"))
    server = SynchronizerServer(Synchronizer(config, SynchronizerSettings(num_islands=2))).start()
    proc = _island(tmp_path / "island0", "--no-wait", "--overlap", "0",
                   DILOCO_SYNCHRONIZER=server.address, DILOCO_ISLAND="0", DILOCO_NUM_ISLANDS="2")
    try:
        deadline = time.monotonic() + 180  # a hang guard for the start (imports under load)
        while not any(r.open for r in server.service.status().rounds.values()):  # its first send waits for a quorum
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)[0][-3000:]
            time.sleep(0.1)
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)  # a hang guard: the wait alone is push_wait, 120 s
        took = time.monotonic() - stopped_at
        status = server.service.status()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        server.stop(grace=0)
    assert proc.returncode == EXIT_ON_SIGTERM, out[-3000:]  # ended by our handler, not killed by the signal
    assert took < 20, f"SIGTERM took {took:.1f} s to end a blocked Fabric island\n{out[-3000:]}"
    assert status.islands[0].left and status.live_islands == [], status.islands
    assert not (tmp_path / "island0" / "rank0.pt").exists()  # the loop did not run on to its end


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DILOCO_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(procs, timeout=240):
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        assert proc.returncode == 0, out[-3000:]


@pytest.mark.slow
def test_two_fabric_islands_share_one_synchronizer_and_end_on_the_global_model(tmp_path):
    config = RunConfig(
        schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1),
        merge=MergeConfig(min_quorum=2, grace_gamma=0.0),
        codec=CodecConfig(uplink="fp32", downlink="fp32"),
    )
    server = SynchronizerServer(Synchronizer(config)).start()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPT), str(tmp_path / f"island{i}")],
                env=_env(DILOCO_SYNCHRONIZER=server.address, DILOCO_ISLAND=str(i), DILOCO_NUM_ISLANDS="2"),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for i in range(2)
        ]
        _run(procs)
        status = server.service.status()
        results = [torch.load(tmp_path / f"island{i}" / "rank0.pt", weights_only=False) for i in range(2)]
        # the island that ended last holds the final global model (the first to end left the run,
        # and the other's last rounds may have closed without it)
        final = [holds_final_global_model(r["weights"], server.service, 2) for r in results]
    finally:
        server.stop(grace=0)
    # each island saw its own half of the data: 512 samples / 2 islands / batch 16 = 16 steps per epoch
    assert [len(r["losses"]) for r in results] == [32, 32]
    assert all(isl.accepted >= 8 for isl in status.islands.values()), status.islands
    assert any(final) and all(isl.left for isl in status.islands.values()), (final, status.islands)


@pytest.mark.slow
def test_a_fabric_island_of_two_ddp_processes_stays_consistent(tmp_path):
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), "--devices", "2"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _run([proc])
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert len(ranks[0]["losses"]) == len(ranks[1]["losses"]) == 32  # 512 samples over 2 ranks, batch 16, 2 epochs
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert torch.equal(a, b)  # every rank applied the same fragments at the same steps
    leader = ranks[0]["metrics"]
    assert leader["diloco/syncs_applied"] >= 6 and leader["diloco/syncs_failed"] == 0
    assert ranks[1]["metrics"]["diloco/syncs_applied"] == leader["diloco/syncs_applied"]
