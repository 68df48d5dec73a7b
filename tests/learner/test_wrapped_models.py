"""Models as users write them join one run with plain islands of the same model: a compiled
submodule, activation checkpointing, bf16-true and bf16-mixed precision (docs/lightning.md#models-as-users-write-them)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_diloco  # noqa: F401  registers the strategy names
from lightning_diloco import DecoupledDiLoCoStrategy
from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.config import CodecConfig, MergeConfig, OuterConfig, RunConfig, ScheduleConfig
from lightning_diloco.core.fragments import build_layout, flatten_fragment
from lightning_diloco.learner.island import IslandLearner
from lightning_diloco.synchronizer.service import Synchronizer
from tests.helpers import SPECS, with_peer_votes
from tests.learner.models import loader, regression_data, trainer, wrapped_regressor
from tests.learner.service_link import ServiceLink

SCRIPT = Path(__file__).with_name("island_script.py")
WAIT_S = 120  # a hang guard only (see tests/learner/test_island.py)
FP32 = dict(uplink_codec="fp32", downlink_codec="fp32")


class RecordingLink(ServiceLink):
    """Keeps every pushed payload, decoded: what the island sent."""

    def __init__(self, service):
        super().__init__(service)
        self.sent: dict[int, torch.Tensor] = {}

    def push(self, contribution):
        payload = contribution.payload
        self.sent[contribution.fragment] = get_codec(contribution.codec).decode(payload, payload.numel() // 4)
        return super().push(contribution)


def test_a_bf16_islands_outer_gradient_is_formed_in_fp32_and_the_global_value_is_rounded_once_into_it():
    config = RunConfig(
        schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1, apply="overwrite"),
        merge=MergeConfig(grace_gamma=0.0, min_quorum=1),
        outer=OuterConfig(lr=1.0, momentum=0.0),
        codec=CodecConfig(uplink="fp32", downlink="fp32"),
    )
    layout = build_layout(SPECS, 2)
    service = Synchronizer(config).start()
    learners = []
    try:
        g = torch.Generator().manual_seed(0)
        seeder = IslandLearner([torch.randn(s.shape, generator=g) for s in SPECS], layout, config, island=0,
                               link=ServiceLink(service), heartbeat_every=60)  # an fp32 island seeds the global model
        learners.append(seeder)
        seeder.link.join(0, 1, SPECS)
        with_peer_votes(service, range(2))  # island 1's entry alone in its round does not wait 10 s for a peer's
        seeder.start()
        params = [torch.zeros(s.shape, dtype=torch.bfloat16) for s in SPECS]
        link = RecordingLink(service)
        info = link.join(1, 1, SPECS)
        island = IslandLearner(params, layout, config, island=1, link=link, heartbeat_every=60)
        learners.append(island)
        island.start(run_step=info.run_step)

        start = service.pull(0)[1]
        base = island.fragments[0].base
        assert base.dtype == torch.float32 and torch.equal(base, start)  # the global value, not its bf16 rounding
        rounded = flatten_fragment([params[i] for i in layout.fragments[0]])
        assert torch.equal(rounded, start.bfloat16().float())  # written into the parameters rounding once
        # what a bf16 base would have lost: nearly every element of an fp32 global model moves when rounded
        assert (rounded != start).float().mean() > 0.9

        for _ in range(2):  # fragment 0 is due after step 2 (P = 2, H = 4)
            with torch.no_grad():
                for p in params:
                    p.add_(0.01)  # stands in for an inner optimizer step, in bf16
            island.after_step(10.0)
        theta = flatten_fragment([params[i] for i in layout.fragments[0]])
        assert island.inbox.wait(lambda: all(island.settled(p) for p in island.in_flight), WAIT_S)  # pushed, merged
        assert torch.equal(link.sent[0], theta - start)  # fp32(theta) - fp32 base: the rounding is carried, not lost
        island.after_step(10.0)  # tau = 1 step later its version is applied
        version, new_global = service.pull(0)
        assert version == 1 and torch.equal(island.fragments[0].base, new_global)
        applied = flatten_fragment([params[i] for i in layout.fragments[0]])
        assert torch.equal(applied, new_global.bfloat16().float())
    finally:
        for learner in learners:
            learner.close()
        service.shutdown()


class StepsTakeTime(Callback):
    """Steps of 20 ms, not one: a round then closes within the overlap of its send, as with a real
    model, instead of the next sends of its fragment being skipped while it is in flight."""

    def on_train_batch_end(self, *args):
        time.sleep(0.02)


def _holds_global_model(model, service, num_fragments: int) -> bool:
    """Whether the module's parameters are the synchronizer's current global model, rounded once to
    their own dtype (compared as sorted multisets, as tests/helpers.py's holds_final_global_model)."""
    dtype = next(model.parameters()).dtype
    final = torch.cat([service.pull(p)[1] for p in range(num_fragments)]).to(dtype).float()
    mine = torch.cat([w.detach().reshape(-1).float() for w in model.parameters()])
    return final.numel() == mine.numel() and torch.equal(torch.sort(final)[0], torch.sort(mine)[0])


@pytest.mark.parametrize(("wrapping", "precision"), [
    ("compiled", "32-true"), ("checkpoint-wrapped", "32-true"), ("checkpointed", "32-true"),
    ("plain", "bf16-true"), ("plain", "bf16-mixed"), ("compiled", "bf16-true"),
])
def test_an_island_as_users_write_it_joins_the_run_of_a_plain_island_and_trains(wrapping, precision):
    """A plain fp32 island starts the run; the wrapped (or bf16) island joins it (on main before
    2026-11-27, compiled and bf16-true islands were refused: layout_mismatch), contributes, and ends
    holding the global model in its own parameters: the canonical names led to the live ones."""
    settings = dict(sync_every=4, num_fragments=2, overlap_steps=1, min_quorum=1, grace_gamma=0.0, **FP32)
    from lightning_diloco.core.settings import config_with
    from lightning_diloco.synchronizer.server import SynchronizerServer

    server = SynchronizerServer(Synchronizer(config_with(settings)), host="127.0.0.1", port=0).start()
    try:
        plain = wrapped_regressor("plain")
        trainer(DecoupledDiLoCoStrategy(synchronizer=server.address, island=0, num_islands=2), max_epochs=1).fit(
            plain, loader(regression_data()))
        before = server.service.versions()
        model = wrapped_regressor(wrapping, seed=1)
        strategy = DecoupledDiLoCoStrategy(synchronizer=server.address, island=1, num_islands=2)
        trainer(strategy, max_epochs=3, precision=precision, callbacks=[StepsTakeTime()]).fit(model, loader(regression_data()))
        status = server.service.status()
        holds = _holds_global_model(model, server.service, 2)
        server_versions = server.service.versions()
    finally:
        server.stop(grace=0)
    assert next(model.parameters()).dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    assert len(model.losses) == 24 and all(math.isfinite(x) for x in model.losses)
    assert sum(model.losses[-4:]) < sum(model.losses[:4])
    # 24 steps, H = 4: each of the 2 fragments due 6 times (a send is skipped while the fragment's
    # last one is in flight: these steps take a millisecond, its round closes on the synchronizer's clock)
    assert status.islands[1].accepted >= 4 and strategy.final_metrics["diloco/syncs_failed"] == 0, status.islands
    after = [server_versions[p] for p in range(2)]
    assert all(after[p] > before[p] for p in range(2)) and sum(after) >= sum(before.values()) + 4, (before, after)
    assert holds


def test_a_compiled_bf16_true_island_resumes_from_its_lightning_checkpoint_as_if_never_stopped(tmp_path):
    """The checkpoint holds the module's own (``_orig_mod.``, bf16) weights and the learner's fp32
    bases under the canonical layout's hash: a fresh compiled module resumes from it."""
    data = regression_data()
    settings = dict(sync_every=4, num_fragments=2, overlap_steps=0, end_with_global_model=False, **FP32)

    straight = wrapped_regressor("compiled")
    trainer(DecoupledDiLoCoStrategy(**settings), max_epochs=2, precision="bf16-true").fit(straight, loader(data))

    first = wrapped_regressor("compiled")
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(DecoupledDiLoCoStrategy(**settings), max_epochs=1, precision="bf16-true", enable_checkpointing=True,
            callbacks=[ckpt]).fit(first, loader(data))
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert "net._orig_mod.0.weight" in saved["state_dict"] and saved["state_dict"]["net._orig_mod.0.weight"].dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for b in saved["decoupled_diloco"]["learner"]["bases"])

    resumed = wrapped_regressor("compiled", seed=123)  # different init: everything must come from the checkpoint
    t = trainer(DecoupledDiLoCoStrategy(**settings), max_epochs=2, precision="bf16-true")
    t.fit(resumed, loader(data), ckpt_path=tmp_path / "last.ckpt")
    assert t.strategy.final_metrics["diloco/min_version"] == 8  # 32 steps / H=4 per fragment
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


ISLANDS = [  # (--wrapping, --precision) of each island of the run below, island 0 the plain fp32 one
    ("plain", "32-true"), ("compiled", "32-true"), ("checkpoint-wrapped", "32-true"), ("plain", "bf16-true"),
    ("plain", "bf16-mixed"),
]


@pytest.mark.slow
def test_compiled_checkpointed_and_bf16_islands_train_in_one_run_with_a_plain_island(tmp_path):
    """Five island processes, one synchronizer: each round waits for three of them (so merges mix
    kinds), every island contributes, the global model takes outer steps, and no loss is lost to
    bf16 (each island's losses are finite and fall)."""
    from lightning_diloco.core.config import CodecConfig, MergeConfig, RunConfig, ScheduleConfig
    from lightning_diloco.synchronizer.server import SynchronizerServer

    config = RunConfig(
        schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1),
        merge=MergeConfig(min_quorum=3, grace_gamma=0.0),
        codec=CodecConfig(uplink="fp32", downlink="fp32"),
    )
    server = SynchronizerServer(Synchronizer(config)).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DILOCO_", "MASTER_", "LOCAL_RANK", "WORLD_SIZE"))}
        procs = [
            subprocess.Popen(
                [sys.executable, str(SCRIPT), str(tmp_path / f"island{i}"), "--wrapping", wrapping, "--precision",
                 precision, "--epochs", "4"],
                env={**env, "OMP_NUM_THREADS": "1", "DILOCO_SYNCHRONIZER": server.address, "DILOCO_ISLAND": str(i),
                     "DILOCO_NUM_ISLANDS": str(len(ISLANDS))},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            )
            for i, (wrapping, precision) in enumerate(ISLANDS)
        ]
        outputs = [_finish(proc, timeout=400) for proc in procs]
        status = server.service.status()
        versions = server.service.versions()
    finally:
        server.stop(grace=0)
    for (wrapping, precision), (code, out) in zip(ISLANDS, outputs):
        assert code == 0, f"island {wrapping} {precision} failed:\n{out[-3000:]}"
    results = [torch.load(tmp_path / f"island{i}" / "rank0.pt", weights_only=False) for i in range(len(ISLANDS))]
    for i, ((wrapping, precision), result) in enumerate(zip(ISLANDS, results)):
        losses, island = result["losses"], status.islands[i]
        # each kind of island contributed (how many of its sends were merged depends on when its
        # process started: a compiled one on a loaded machine had 1 of its sends merged, not 2)
        assert island.accepted >= 1 and result["metrics"]["diloco/syncs_failed"] == 0, (wrapping, precision, island)
        assert all(math.isfinite(x) for x in losses) and sum(losses[-4:]) < sum(losses[:4]), (wrapping, precision, losses)
        assert result["weights"][0].dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    assert status.accepted["merged"] >= 10 and min(versions.values()) >= 3, (status.accepted, versions)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    """The process's exit code and output; past ``timeout`` s its process group is killed."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n(killed after {timeout} s)"
    return proc.returncode, out
