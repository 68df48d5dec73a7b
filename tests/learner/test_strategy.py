"""The strategy in one process with the embedded synchronizer: behaviour and exact equivalences."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_diloco  # noqa: F401  registers the strategy names
from lightning_diloco import DecoupledDiLoCoStrategy
from lightning_diloco.core.settings import config_with, load_run_config, run_settings, setting, value_of
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from tests.helpers import sample_settings
from tests.learner.models import TinyRegressor, loader, regression_data, trainer

FP32 = dict(uplink_codec="fp32", downlink_codec="fp32")


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_strategy_name_trains_a_tiny_model_and_syncs():
    model = TinyRegressor()
    t = trainer("decoupled_diloco", max_epochs=3)
    t.fit(model, loader(regression_data()))
    first, last = sum(model.losses[:8]) / 8, sum(model.losses[-8:]) / 8
    assert last < 0.5 * first
    assert isinstance(t.strategy, DecoupledDiLoCoStrategy)
    metrics = t.strategy.final_metrics
    # 48 steps, H = 24, P lowered to the model's 4 tensors: 8 sends due, after steps 6, 12, ..., 48;
    # each lands tau = 2 steps later at the earliest (7 applied on an idle machine), and the last
    # one is still in flight when training ends. This model's steps take milliseconds, so on a
    # loaded machine a round can still be open 24 steps later, when its fragment is due again:
    # that send is skipped (never two of one fragment in flight; measured beside a benchmark: 6
    # sent, 2 skipped in 1 of 5 runs), and arrivals land later. Every due send is accounted for,
    # none fails, and every fragment got an outer step
    due = metrics["diloco/syncs_sent"] + metrics["diloco/syncs_skipped"]
    assert due == 8 and metrics["diloco/syncs_sent"] >= 4 and 1 <= metrics["diloco/syncs_applied"] <= 7
    assert metrics["diloco/syncs_failed"] == 0
    assert metrics["diloco/bytes_up"] > 0 and metrics["diloco/min_version"] >= 1


def test_a_one_process_island_calls_its_embedded_synchronizer_without_grpc():
    """No server, no port and no gRPC threads beside the training loop (over loopback gRPC the
    island's own traffic cost 3-4 ms of CPU per step): a one-process run that syncs,
    and counts its bytes up and down, never even loads gRPC. In a fresh interpreter, since other
    tests load it."""
    root = Path(__file__).resolve().parents[2]
    code = ("import sys, torch, lightning_diloco; torch.set_num_threads(1); "
            "from tests.learner.models import TinyRegressor, loader, regression_data, trainer; "
            "t = trainer('decoupled_diloco', max_epochs=2); t.fit(TinyRegressor(), loader(regression_data())); "
            "m = t.strategy.final_metrics; "
            "print(m['diloco/syncs_sent'], m['diloco/bytes_up'] > 0 < m['diloco/bytes_down'], 'grpc' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    sent, bytes_counted, grpc_loaded = done.stdout.split()[-3:]
    assert float(sent) >= 3 and bytes_counted == "True" and grpc_loaded == "False"  # the run summary's MB up and down


def test_a_one_process_island_runs_without_a_process_group_or_ddp_wrapper():
    """One process: nothing to all-reduce, so no gloo group, no DDP reducer copying gradients, and
    none of Lightning's distributed-only warnings; still island 0 of M's shard of the data."""
    seen = {}

    class Probe(TinyRegressor):
        def training_step(self, batch, batch_idx):
            seen["process group"] = torch.distributed.is_initialized()
            seen["model"] = type(self.trainer.strategy.model).__name__
            seen["sampler"] = self.trainer.train_dataloader.sampler
            return super().training_step(batch, batch_idx)

    model = Probe()
    server = SynchronizerServer(Synchronizer(config_with({"sync_every": 8, "num_fragments": 4})), host="127.0.0.1", port=0).start()
    try:
        t = trainer(DecoupledDiLoCoStrategy(synchronizer=server.address, num_islands=2, sync_every=8), max_epochs=1)
        t.fit(model, loader(regression_data()))
    finally:
        server.stop(grace=0)
    assert seen["process group"] is False and seen["model"] == "Probe"
    assert t.strategy.launcher is None  # DDP's would reset the script's torch thread count
    assert (seen["sampler"].num_replicas, seen["sampler"].rank) == (2, 0)
    assert len(model.losses) == 8  # half of 256 samples in batches of 16
    # validating after fit takes the same path (DDPStrategy.setup would broadcast over a group)
    assert t.validate(model, loader(regression_data(seed=1)), verbose=False)[0]["val_loss"] > 0


def test_lightning_cli_describes_every_strategy_argument():
    """LightningCLI builds its parser with jsonargparse, which reads the ``**kwargs`` TypedDict and
    its Args section."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(DecoupledDiLoCoStrategy, "strategy")
    helps = {action.dest.removeprefix("strategy."): action.help or "" for action in parser._actions
             if action.dest.startswith("strategy.")}
    # every run setting and the DDP arguments by name (**kwargs hid them from the CLI), and no
    # token: LightningCLI saves its arguments in config.yaml (token_file instead)
    assert {s.name for s in run_settings()} | {"find_unused_parameters", "static_graph", "token_file", "synchronizer",
                                              "island", "num_islands", "push_wait"} <= set(helps)
    assert "token" not in helps
    undocumented = [name for name, text in helps.items() if len(text) < 20]
    assert undocumented == []
    assert "comma-separated for shards" in helps["synchronizer"]


def test_lightning_cli_takes_every_setting_by_name_keeps_the_token_out_and_finds_the_monitor(tmp_path, monkeypatch):
    """--trainer.strategy.history and .find_unused_parameters were refused; a token given to the
    CLI was saved in config.yaml in plain text; DiLoCoMonitor needed its full import path."""
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return loader(regression_data())

    (tmp_path / "token").write_text("s3cret\n")
    monkeypatch.chdir(tmp_path)
    cli = LightningCLI(TinyRegressor, Data, run=False, save_config_kwargs={"overwrite": True}, args=[
        "--trainer.strategy=DecoupledDiLoCoStrategy", "--trainer.strategy.history=6",
        "--trainer.strategy.find_unused_parameters=true", f"--trainer.strategy.token_file={tmp_path / 'token'}",
        "--trainer.callbacks+=DiLoCoMonitor", "--trainer.logger=false", "--trainer.max_steps=2",
        "--trainer.enable_progress_bar=false"])
    strategy = cli.trainer.strategy
    assert strategy.run_config.merge.history == 6 and strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert strategy.token == "s3cret"
    assert any(type(c).__name__ == "DiLoCoMonitor" for c in cli.trainer.callbacks)
    cli.trainer.fit(cli.model, cli.datamodule)
    config = (tmp_path / "config.yaml").read_text()
    assert "s3cret" not in config and "token_file" in config


def test_zero_argument_constructor_and_double_registration_work():
    lightning_diloco.register()
    lightning_diloco.register()
    strategy = DecoupledDiLoCoStrategy()
    assert strategy.run_config.schedule.num_fragments == 24 and strategy.island == 0 and strategy.num_islands == 1


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match="overlap_steps=30"):
        DecoupledDiLoCoStrategy(overlap_steps=30)
    with pytest.raises(ValueError, match=r"island=2 must be in \[0, num_islands=2\); set DILOCO_ISLAND"):
        DecoupledDiLoCoStrategy(island=2, num_islands=2, synchronizer="127.0.0.1:1")


def test_an_island_index_without_the_island_count_says_the_count_is_missing(monkeypatch):
    """DILOCO_ISLAND=1 with DILOCO_NUM_ISLANDS forgotten: the count defaulted to 1 and the error told
    the user to set DILOCO_ISLAND below a DILOCO_NUM_ISLANDS they had not set."""
    monkeypatch.delenv("DILOCO_NUM_ISLANDS", raising=False)
    monkeypatch.setenv("DILOCO_ISLAND", "1")
    with pytest.raises(ValueError, match="neither num_islands= nor DILOCO_NUM_ISLANDS was given"):
        DecoupledDiLoCoStrategy(synchronizer="127.0.0.1:1")


@pytest.mark.parametrize("name", [s.name for s in run_settings()])
def test_every_run_setting_is_a_strategy_argument(name):
    """Named in the signature or not, a run setting given by name is a run setting, not a DDP
    argument; a setting added to core/config.py needs no edit here."""
    settings = sample_settings(setting(name))
    assert value_of(DecoupledDiLoCoStrategy(**settings).run_config, name) == settings[name]


def test_run_config_takes_every_setting_at_once_and_named_arguments_override_it(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"merge": {"min_quorum": 3, "outlier_z": 5.0}, "schedule": {"apply": "mix"}}))
    for given in (str(path), json.loads(path.read_text()), load_run_config(path)):
        config = DecoupledDiLoCoStrategy(run_config=given, min_quorum=2, find_unused_parameters=True).run_config
        assert (config.merge.min_quorum, config.merge.outlier_z, config.schedule.apply) == (2, 5.0, "mix")
    strategy = DecoupledDiLoCoStrategy(history=6, find_unused_parameters=True)
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}  # the rest still reaches DDP
    with pytest.raises(ValueError, match="unknown merge settings"):
        DecoupledDiLoCoStrategy(run_config={"merge": {"quorum": 2}})


def test_a_misspelt_argument_is_refused_with_the_name_it_meant():
    """It would otherwise go to DDP, which a one-process island never builds: silently ignored."""
    with pytest.raises(TypeError, match="'min_qorum' \\(did you mean 'min_quorum'\\?\\)"):
        DecoupledDiLoCoStrategy(min_qorum=2)
    with pytest.raises(TypeError, match="'find_unused_params' \\(did you mean 'find_unused_parameters'"):
        DecoupledDiLoCoStrategy(find_unused_params=True)
    # Lightning's own DDPStrategy arguments and DDP's still pass
    assert DecoupledDiLoCoStrategy(process_group_backend="gloo", static_graph=True)._ddp_kwargs == {"static_graph": True}


def test_an_island_of_several_without_a_synchronizer_is_refused_with_the_fix(monkeypatch):
    """An embedded synchronizer would let it train alone on 1/M of the data, without a word."""
    with pytest.raises(ValueError, match="num_islands=2 has no synchronizer.*DILOCO_SYNCHRONIZER=host:port.*lightning-diloco run"):
        DecoupledDiLoCoStrategy(island=1, num_islands=2)
    monkeypatch.setenv("DILOCO_ISLAND", "1")
    monkeypatch.setenv("DILOCO_NUM_ISLANDS", "2")
    with pytest.raises(ValueError, match="island 1 of num_islands=2 has no synchronizer"):
        DecoupledDiLoCoStrategy()
    assert DecoupledDiLoCoStrategy(synchronizer="127.0.0.1:1").num_islands == 2


def test_environment_supplies_island_settings(monkeypatch):
    monkeypatch.setenv("DILOCO_ISLAND", "1")
    monkeypatch.setenv("DILOCO_NUM_ISLANDS", "3")
    monkeypatch.setenv("DILOCO_SYNCHRONIZER", "127.0.0.1:1,127.0.0.1:2")
    s = DecoupledDiLoCoStrategy()
    assert (s.island, s.num_islands, s.address) == (1, 3, "127.0.0.1:1,127.0.0.1:2")
    assert DecoupledDiLoCoStrategy(island=0).island == 0  # an explicit argument wins


def test_every_step_sync_with_plain_averaging_equals_plain_lightning_training():
    """H = 1, P = 1, tau = 0, outer lr 1, momentum 0, fp32: the global model is the local one.

    The baseline is Lightning's own DDP strategy with one process (same data pipeline: Lightning
    shuffles training data through its distributed sampler)."""
    data = regression_data()
    plain = TinyRegressor()
    try:
        trainer("ddp", max_epochs=2).fit(plain, loader(data))
    finally:  # Lightning keeps its gloo group (and the store's listening port) after fit
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    diloco = TinyRegressor()
    strategy = DecoupledDiLoCoStrategy(sync_every=1, num_fragments=1, overlap_steps=0, outer_lr=1.0, outer_momentum=0.0, **FP32)
    trainer(strategy, max_epochs=2).fit(diloco, loader(data))
    assert len(plain.losses) == len(diloco.losses) == 32
    assert torch.allclose(torch.tensor(plain.losses), torch.tensor(diloco.losses), rtol=1e-5, atol=1e-6)
    for a, b in zip(_weights(plain), _weights(diloco)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_synchronous_diloco_matches_a_plain_pytorch_reference_loop():
    """P = 1, tau = 0, fp32, H = 4, the paper's overwrite: inner AdamW, outer Nesterov on Delta = Theta - theta."""
    data = regression_data()
    H, lr, mu = 4, 0.7, 0.9
    diloco = TinyRegressor()
    strategy = DecoupledDiLoCoStrategy(sync_every=H, num_fragments=1, overlap_steps=0, end_with_global_model=False,
                                       apply="overwrite", **FP32)
    trainer(strategy, max_epochs=2, use_distributed_sampler=False).fit(diloco, loader(data))  # the loop's order

    reference = TinyRegressor()
    inner = reference.configure_optimizers()
    global_params = [p.detach().clone() for p in reference.parameters()]
    outer = torch.optim.SGD(global_params, lr=lr, momentum=mu, nesterov=True)
    step = 0
    for _ in range(2):
        for x, y in loader(data):
            inner.zero_grad()
            torch.nn.functional.mse_loss(reference.net(x), y).backward()
            inner.step()
            step += 1
            if step % H == 0:
                with torch.no_grad():
                    for g, p in zip(global_params, reference.parameters()):
                        g.grad = g - p
                    outer.step()
                    for g, p in zip(global_params, reference.parameters()):
                        p.copy_(g)
    assert step == 32
    for a, b in zip(_weights(reference), _weights(diloco)):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_checkpoint_resume_continues_counters_and_matches_an_uninterrupted_run(tmp_path):
    data = regression_data()
    settings = dict(sync_every=4, num_fragments=2, overlap_steps=0, end_with_global_model=False, **FP32)

    straight = TinyRegressor()
    uninterrupted = DecoupledDiLoCoStrategy(**settings)
    trainer(uninterrupted, max_epochs=2).fit(straight, loader(data))

    first = TinyRegressor()
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(DecoupledDiLoCoStrategy(**settings), max_epochs=1, enable_checkpointing=True, callbacks=[ckpt]).fit(first, loader(data))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["decoupled_diloco"]["learner"]["step"] == 16

    resumed = TinyRegressor(seed=123)  # different init: everything must come from the checkpoint
    t = trainer(DecoupledDiLoCoStrategy(**settings), max_epochs=2)
    t.fit(resumed, loader(data), ckpt_path=tmp_path / "last.ckpt")
    assert t.strategy.final_metrics["diloco/min_version"] == 8  # 32 steps / H=4 per fragment
    # the counters go on from the checkpoint's, not from 0: 32 steps sent 16 times either way
    assert t.strategy.final_metrics["diloco/syncs_sent"] == uninterrupted.final_metrics["diloco/syncs_sent"] == 16
    for a, b in zip(_weights(straight), _weights(resumed)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_overlapped_fragments_apply_tau_steps_later_and_never_twice_in_flight():
    model = TinyRegressor()
    strategy = DecoupledDiLoCoStrategy(sync_every=4, num_fragments=4, overlap_steps=2, **FP32)
    trainer(strategy, max_epochs=1).fit(model, loader(regression_data()))
    m = strategy.final_metrics
    # one fragment due per step; a reply slower than H - tau steps makes its next turn a skip
    assert m["diloco/syncs_sent"] + m["diloco/syncs_skipped"] == 16
    assert m["diloco/syncs_sent"] - m["diloco/syncs_applied"] <= 4  # at most P still in flight at the end
    assert m["diloco/syncs_failed"] == 0


def test_the_best_checkpoint_holds_the_weights_that_earned_its_score(tmp_path):
    """DiLoCoMonitor(evaluate_global=True) scores the global model: the checkpoint ModelCheckpoint
    keeps for that score must hold the global weights, not the local ones."""
    from lightning_diloco import DiLoCoMonitor

    data = regression_data()
    model = TinyRegressor()
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=1, mode="min")
    strategy = DecoupledDiLoCoStrategy(sync_every=8, num_fragments=2, overlap_steps=2, **FP32)
    trainer(strategy, max_epochs=3, enable_checkpointing=True, callbacks=[DiLoCoMonitor(evaluate_global=True), ckpt],
            check_val_every_n_epoch=1).fit(model, loader(data), loader(data))
    best = TinyRegressor()
    best.load_state_dict(torch.load(ckpt.best_model_path, weights_only=True)["state_dict"])
    x, y = data.tensors
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(best.net(x), y)
    assert float(loss) == pytest.approx(float(ckpt.best_model_score), rel=1e-5)


@pytest.mark.parametrize("devices", [1, 2])
def test_islands_seeded_apart_take_disjoint_shards_that_cover_the_data(devices, monkeypatch):
    """Each island's process seeds itself differently (the recipes: seed + island); the samplers
    still cut one permutation, so the M x W shards partition the dataset as DDP's ranks would."""
    from lightning.pytorch import seed_everything
    from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler

    islands, n = 4, 1003  # not a multiple of the ranks: the sampler pads the last ones
    dataset = list(range(n))
    shards = []
    for island in range(islands):
        seed_everything(100 + island, verbose=False)  # sets PL_GLOBAL_SEED, which Lightning's sampler would take
        strategy = DecoupledDiLoCoStrategy(synchronizer="127.0.0.1:1", island=island, num_islands=islands, data_seed=7)
        for rank in range(devices):
            monkeypatch.setattr(type(strategy), "num_processes", property(lambda self: devices))
            monkeypatch.setattr(type(strategy), "global_rank", property(lambda self, rank=rank: rank))
            loader_ = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)
            sampler = _get_distributed_sampler(loader_, shuffle=True, overfit_batches=0, mode=None,
                                               **strategy.distributed_sampler_kwargs)
            sampler.set_epoch(3)
            shards.append(list(sampler))
    seen = [i for shard in shards for i in shard]
    assert set(seen) == set(dataset)  # nothing left unseen in the epoch
    assert len(seen) - len(set(seen)) < islands * devices  # only the sampler's padding repeats an index


def test_run_settings_reach_the_loggers_and_fit_ends_with_a_summary(tmp_path, caplog):
    """A logger's hyperparameters say which run produced the curves; the end of fit says what the
    island's syncs came to."""
    import re

    from lightning.pytorch.loggers import CSVLogger

    caplog.set_level("INFO", logger="lightning.pytorch")
    logger = CSVLogger(tmp_path)
    t = trainer("decoupled_diloco", max_epochs=1, logger=logger)
    t.fit(TinyRegressor(), loader(regression_data()))
    hparams = logger.experiment.hparams
    assert (hparams["diloco/island"], hparams["diloco/num_islands"], hparams["diloco/synchronizer"]) == (0, 1, "embedded")
    assert hparams["diloco/num_fragments"] == 4  # as the synchronizer has it: lowered to the model's 4 tensors
    assert hparams["diloco/sync_every"] == 24 and hparams["diloco/uplink_codec"] == "int4" and "diloco/outer_lr" in hparams
    assert "diloco/sync_every: 24" in (tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text()
    assert re.search(r"Decoupled DiLoCo, island 0: [1-9]\d* contributions sent, .* MB up", caplog.text), caplog.text[-2000:]


def test_each_metric_has_one_name_in_the_logs_and_the_progress_bar(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_diloco import DiLoCoMonitor

    t = trainer("decoupled_diloco", max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=4, callbacks=[DiLoCoMonitor()])
    t.fit(TinyRegressor(), loader(regression_data()))
    columns = set(next(csv.reader(open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv"))))
    assert {"diloco/syncs_applied", "diloco/min_version", "diloco/synchronizer_reachable"} <= columns
    assert not columns & {"diloco/applied", "diloco/version", "diloco/reachable"}  # once named two ways
    assert {"diloco/syncs_applied", "diloco/min_version"} <= set(t.progress_bar_metrics)


def test_the_islands_metrics_land_in_the_modules_rows(tmp_path):
    """One row per logged step in a CSV log (W&B's step count is not doubled either)."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    class Logged(TinyRegressor):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss)
            return loss

    t = trainer("decoupled_diloco", max_epochs=1, logger=CSVLogger(tmp_path), log_every_n_steps=4)
    t.fit(Logged(), loader(regression_data()))
    rows = list(csv.DictReader(open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv")))
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)) == 4  # 16 steps logged every 4
    assert all(row["train_loss"] and row["diloco/syncs_sent"] for row in rows)


def test_islands_of_different_sizes_train_on_disjoint_shards_that_cover_the_data():
    """A 2-rank island and a one-process island in one run (M = 2), shuffled: disjoint samples."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from torch.utils.data import DistributedSampler

    def sampler(island, world, rank):
        strategy = DecoupledDiLoCoStrategy(synchronizer="127.0.0.1:1", island=island, num_islands=2)
        strategy.parallel_devices = [torch.device("cpu")] * world
        strategy.cluster_environment = LightningEnvironment()
        strategy.cluster_environment.set_global_rank(rank)
        return DistributedSampler(range(64), shuffle=True, **strategy.distributed_sampler_kwargs)  # the run's seed

    shards = {(0, r): set(sampler(0, 2, r)) for r in range(2)} | {(1, 0): set(sampler(1, 1, 0))}
    assert all(len(s) == 16 for k, s in shards.items() if k[0] == 0) and len(shards[1, 0]) == 32
    assert set().union(*shards.values()) == set(range(64))  # each sample once: 16 + 16 + 32 = 64


def test_a_preset_on_a_small_model_warns_of_no_conflict_and_a_real_one_is_named(recwarn):
    """run_config=low_bandwidth() (every setting at once) on a model of fewer tensors than its 24
    fragments once warned "ignoring num_fragments=24 ... Set them on the synchronizer instead",
    about the embedded synchronizer fitting P to the model, which nothing can undo. A synchronizer
    of its own with other settings is still named, setting by setting."""
    from lightning_diloco.core.presets import low_bandwidth

    t = trainer(DecoupledDiLoCoStrategy(run_config=low_bandwidth()), max_epochs=1)
    t.fit(TinyRegressor(), loader(regression_data()))
    assert not [w for w in recwarn if "authoritative" in str(w.message)]

    server = SynchronizerServer(Synchronizer(config_with({"sync_every": 8, "num_fragments": 4})), host="127.0.0.1", port=0).start()
    try:
        t = trainer(DecoupledDiLoCoStrategy(synchronizer=server.address, num_islands=1, run_config=low_bandwidth(), sync_every=8),
                    max_epochs=1)
        with pytest.warns(UserWarning, match="authoritative") as caught:
            t.fit(TinyRegressor(), loader(regression_data()))
    finally:
        server.stop(grace=0)
    message = next(str(w.message) for w in caught if "authoritative" in str(w.message))
    assert "uplink_codec='int2' (synchronizer: 'fp32')" in message or "uplink_codec='int2' (synchronizer: 'int4')" in message
    assert "block_size=128 (synchronizer: 64)" in message and "num_fragments" not in message
