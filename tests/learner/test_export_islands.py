"""The trained model out of a real run: two islands (processes) train a tiny Hugging Face Llama on
a synchronizer of two shards; the global model is exported from the running synchronizer and from
its checkpoint directories, and loads into the LightningModule and with ``from_pretrained``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

from lightning_diloco.cli import main
from lightning_diloco.core.config import MergeConfig, RunConfig, ScheduleConfig
from lightning_diloco.core.fragments import split_fragment
from lightning_diloco.synchronizer.credentials import island_credential
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from tests.learner.test_hf_models import CausalLM, CountingSequences, _dense

SCRIPT = Path(__file__).with_name("hf_island_script.py")
TOKEN = "export-islands-token"
ISLAND_TIMEOUT_S = 220  # below the test's own pytest timeout (300 s), so this one fires
pytestmark = pytest.mark.slow


def _islands(addresses: str, out) -> list[dict[str, torch.Tensor]]:
    """Run islands 0 and 1 to the end, each with its own credential; what each holds then."""
    procs = []
    for i in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DILOCO_", "MASTER_", "LOCAL_RANK", "WORLD_SIZE"))}
        env.update(OMP_NUM_THREADS="1", DILOCO_SYNCHRONIZER=addresses, DILOCO_ISLAND=str(i), DILOCO_NUM_ISLANDS="2",
                   DILOCO_TOKEN=island_credential(TOKEN, i))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(out / f"island{i}.pt")], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=ISLAND_TIMEOUT_S)
            assert proc.returncode == 0, output[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return [torch.load(out / f"island{i}.pt", weights_only=True) for i in range(2)]


def _synchronizer_tensors(servers) -> dict[str, torch.Tensor]:
    """The synchronizers' global fragments, split by their own layout (not through the export)."""
    out = {}
    for server in servers:
        snapshot = server.service.snapshot()
        for p, frag in snapshot.fragments.items():
            specs = snapshot.layout.fragment_specs(p)
            out.update({s.name: t.clone() for s, t in zip(specs, split_fragment(frag.value, specs))})
    return out


def _eval_loss(model, batch, params=None) -> float:
    with torch.no_grad():
        if params is None:
            return float(model(**batch, labels=batch["input_ids"]).loss)
        return float(functional_call(model, params, args=(), kwargs={**batch, "labels": batch["input_ids"]}, strict=False).loss)


def _assert_same(exported: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert exported.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(exported[name], value), name


def test_the_global_model_of_a_two_island_run_exports_both_ways_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    config = RunConfig(schedule=ScheduleConfig(num_fragments=4, sync_every=4, overlap_steps=1),
                       merge=MergeConfig(min_quorum=1))
    servers = [SynchronizerServer(Synchronizer(config, SynchronizerSettings(shard=s, num_shards=2, run_id="hf-run", checkpoint_dir=tmp_path / f"shard{s}")), token=TOKEN).start() for s in range(2)]
    addresses = ",".join(s.address for s in servers)
    hf_config = tmp_path / "config"
    _dense().config.save_pretrained(hf_config)
    try:
        islands = _islands(addresses, tmp_path)
        expected = _synchronizer_tensors(servers)
        steps = [s.service.run.state.outer_steps for s in servers]
        live = tmp_path / "live"
        assert main(["export", "--synchronizer", addresses, "--token", TOKEN, "--out", str(live),
                     "--hf-config", str(hf_config / "config.json")]) == 0
        assert [s.service.status().live_islands for s in servers] == [[], []]  # the export joined nothing
    finally:
        for server in servers:
            server.stop(grace=0)  # writes each shard's final checkpoint
    assert all(n >= 4 for n in steps), steps  # the islands' work moved the global model on both shards

    # the state dict is the synchronizer's global fragments, by the LightningModule's own names
    exported = torch.load(live / "state_dict.pt", weights_only=True)
    _assert_same(exported, expected)
    # what each island holds at the end of fit is not it: the global model as that island last
    # received it, through the int4 downlink (an approximation), or its own weights
    assert all(any(not torch.equal(held[n], exported[n]) for n in exported) for held in islands)
    module = CausalLM(_dense())
    module.load_state_dict(exported)  # strict: every parameter of the module, nothing else
    # the synchronizer is gone: its checkpoint directories give the same model
    saved = tmp_path / "saved"
    assert main(["export", "--checkpoint-dir", str(tmp_path / "shard0"), str(tmp_path / "shard1"), "--out", str(saved)]) == 0
    _assert_same(torch.load(saved / "state_dict.pt", weights_only=True), expected)

    # the Hugging Face folder loads with from_pretrained, and gives the module's logits
    hf = AutoModelForCausalLM.from_pretrained(live / "hf")
    batch = {k: torch.stack([CountingSequences()[i][k] for i in range(0, 256, 8)]) for k in ("input_ids", "attention_mask")}
    module.eval()
    hf.eval()
    with torch.no_grad():
        assert torch.equal(hf(**batch).logits, module.model(**batch).logits)
    # the exported model's eval loss is the synchronizer's global model's (its tensors put into a
    # fresh model by name, without the export's code)
    fresh = _dense().eval()
    global_loss = _eval_loss(fresh, batch, {k.removeprefix("model."): v for k, v in expected.items()})
    assert _eval_loss(hf, batch) == global_loss
    assert global_loss < _eval_loss(fresh, batch)  # and it is a trained model, not the initial one
