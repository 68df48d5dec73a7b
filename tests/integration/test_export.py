"""The global model out of a run (`lightning-diloco export`, ``load_global_model``): from a running
synchronizer of two shards over gRPC, and from their checkpoint directories; the refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

import lightning_diloco
from lightning_diloco.cli import main
from lightning_diloco.core.global_model import find_prefix, from_checkpoints
from lightning_diloco.core.state import SynchronizerState, owned_by_shard
from lightning_diloco.learner.export import read_global_model
from lightning_diloco.synchronizer.credentials import island_credential
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.synchronizer.settings import SynchronizerSettings
from lightning_diloco.transport.client import SynchronizerClient
from tests.helpers import SPECS, layout, run_config

TOKEN = "export-test-token"


class Model(nn.Module):
    """The module whose parameters are tests.helpers.SPECS, by name, shape and role."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.layer = nn.Linear(4, 8)
        self.head = nn.Linear(8, 4, bias=False)


def _global_values(seed=0):
    """A value for every tensor of tests.helpers.SPECS, in their order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s.shape, generator=g) for s in SPECS]


@pytest.fixture
def shards(tmp_path):
    """Two running shards of one run (token, checkpoint directories), each fragment one outer step
    past its seed; no island has joined."""
    config = run_config(num_fragments=2)
    params = _global_values()
    servers = []
    for shard in range(2):
        state = SynchronizerState.from_parameters(config, layout(config), params, owned=owned_by_shard(shard, 2))
        for frag in state.fragments.values():
            frag.apply(torch.full_like(frag.value, 0.5))
        service = Synchronizer(config, SynchronizerSettings(shard=shard, num_shards=2, run_id="run-a", checkpoint_dir=tmp_path / f"shard{shard}"), state=state)
        servers.append(SynchronizerServer(service, token=TOKEN).start())
    yield servers
    for server in servers:
        server.stop(grace=0)


def _address(servers) -> str:
    return ",".join(s.address for s in servers)


def _exact(servers) -> dict[int, torch.Tensor]:
    return {p: f.value for s in servers for p, f in s.service.snapshot().fragments.items()}


def test_export_from_a_running_synchronizer_is_its_global_fragments_and_disturbs_nothing(shards):
    before = [s.service.status() for s in shards]
    model = read_global_model(synchronizer=_address(shards), token=TOKEN)
    exact = _exact(shards)
    assert model.versions == {0: 1, 1: 1} and model.run_id == "run-a"
    assert sorted(model.values) == [0, 1] and all(torch.equal(model.values[p], exact[p]) for p in exact)
    after = [s.service.status() for s in shards]
    for b, a in zip(before, after):  # no island joined, none is live, nothing moved or was counted
        assert a.islands == {} and a.live_islands == [] and a.versions == b.versions
        assert a.accepted == b.accepted and a.refused == b.refused and a.bytes_out == b.bytes_out

    module = Model()
    lightning_diloco.load_global_model(module, synchronizer=_address(shards), token=TOKEN)
    tensors = model.tensors()
    assert list(tensors) == [s.name for s in SPECS]  # the trained module's own names
    for name, param in module.named_parameters():
        assert torch.equal(param, tensors[name]), name


def test_an_export_during_a_run_leaves_the_joined_island_as_it_was(shards):
    with SynchronizerClient(_address(shards), token=island_credential(TOKEN, 0), max_retries=1) as island:
        island.join(0, 1, SPECS)
        sessions = list(island.sessions)
        model = read_global_model(synchronizer=_address(shards), token=TOKEN)
        assert island.heartbeat(0, 5, 0.1, schedule_step=5).versions == model.versions  # its session still holds
        assert island.sessions == sessions and island.pull(0)[0] == 1
    for server in shards:
        status = server.service.status()
        assert list(status.islands) == [0] and status.live_islands == [0]  # the only island, the export none


def test_export_from_checkpoint_directories_equals_the_running_synchronizers(shards, tmp_path):
    for server in shards:
        server.service.checkpoint()
    dirs = [tmp_path / "shard1", tmp_path / "shard0"]  # any order
    in_progress = tmp_path / "shard0" / ".synchronizer-000000000009.pt.x1.tmp"  # a running synchronizer's write
    in_progress.write_bytes(b"partial")
    live = read_global_model(synchronizer=_address(shards), token=TOKEN)
    saved = read_global_model(checkpoint_dirs=dirs)
    assert saved.versions == live.versions and saved.layout.hash == live.layout.hash
    assert all(torch.equal(saved.values[p], live.values[p]) for p in live.values)
    assert in_progress.exists()  # read only: a start would remove it, the export leaves it to its writer

    out = tmp_path / "out"
    assert main(["export", "--checkpoint-dir", *map(str, dirs), "--out", str(out)]) == 0
    exported = torch.load(out / "state_dict.pt", weights_only=True)
    module = Model()
    module.load_state_dict(exported)  # strict: every parameter, by its own name
    assert all(torch.equal(exported[n], t) for n, t in live.tensors().items())
    assert json.loads((out / "export.json").read_text())["versions"] == {"0": 1, "1": 1}


def test_the_cli_exports_from_a_running_synchronizer_with_the_token_file(shards, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    out = tmp_path / "out"
    assert main(["export", "--synchronizer", _address(shards), "--token-file", str(token_file), "--out", str(out)]) == 0
    assert "exported run run-a: 4 tensors" in capsys.readouterr().out
    exported = torch.load(out / "state_dict.pt", weights_only=True)
    exact = read_global_model(synchronizer=_address(shards), token=TOKEN).tensors()
    assert exported.keys() == exact.keys() and all(torch.equal(exported[n], exact[n]) for n in exact)


def test_an_island_credential_or_a_wrong_token_is_refused(shards):
    with pytest.raises(ValueError, match="the credential of island 0 cannot export the global model: it takes the run's token"):
        read_global_model(synchronizer=_address(shards), token=island_credential(TOKEN, 0))
    with pytest.raises(ValueError, match="unauthenticated: missing or wrong token.*the export takes the run's token"):
        read_global_model(synchronizer=_address(shards), token="wrong")
    assert shards[0].service.tally.refused["unauthenticated"] == 2  # each refused by the server, at its first call


def test_the_shards_must_all_be_given_in_order(shards):
    with pytest.raises(ValueError, match="is shard 0 of 2, given as shard 0 of 1: give every shard's address"):
        read_global_model(synchronizer=shards[0].address, token=TOKEN)
    with pytest.raises(ValueError, match="is shard 1 of 2, given as shard 0 of 2"):
        read_global_model(synchronizer=f"{shards[1].address},{shards[0].address}", token=TOKEN)


def test_checkpoint_directories_missing_a_shard_or_of_two_runs_are_refused(shards, tmp_path, capsys):
    for server in shards:
        server.service.checkpoint()
    with pytest.raises(ValueError, match=r"the run has 2 synchronizer shards and shard\(s\) \[1\] were not given"):
        from_checkpoints([tmp_path / "shard0"])
    with pytest.raises(ValueError, match="checkpoint directory .*shard7 does not exist"):
        from_checkpoints([tmp_path / "shard0", tmp_path / "shard7"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no synchronizer checkpoint"):
        from_checkpoints([tmp_path / "empty"])
    with pytest.raises(ValueError, match="are both shard 0: give each shard once"):
        shutil.copytree(tmp_path / "shard0", tmp_path / "copy0")
        from_checkpoints([tmp_path / "shard0", tmp_path / "copy0"])
    # shard 1 of another run (its own id), beside shard 0 of this one
    config = run_config(num_fragments=2)
    other = SynchronizerState.from_parameters(config, layout(config), _global_values(seed=1), owned=owned_by_shard(1, 2))
    other.identity = {"run_id": "run-b", "shard": 1, "num_shards": 2}
    (tmp_path / "other1").mkdir()
    other.save(tmp_path / "other1")
    with pytest.raises(ValueError, match="is run 'run-a' and .*other1 is run 'run-b': give the shards of one run only"):
        from_checkpoints([tmp_path / "shard0", tmp_path / "other1"])
    with pytest.raises(SystemExit) as exited:
        main(["export", "--checkpoint-dir", str(tmp_path / "shard0"), str(tmp_path / "other1"), "--out", str(tmp_path / "o")])
    assert exited.value.code == 2
    assert "lightning-diloco export: error: " in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_module_that_is_not_the_trained_model_is_refused_naming_the_difference(shards):
    model = read_global_model(synchronizer=_address(shards), token=TOKEN)
    wider = Model()
    wider.head = nn.Linear(8, 5, bias=False)
    with pytest.raises(ValueError, match=r"tensor 'head.weight' is \(4, 8\) in the run and \(5, 8\) in the module"):
        model.load_into(wider)
    extra = Model()
    extra.head = nn.Linear(8, 4)  # a bias the run never had
    with pytest.raises(ValueError, match=r"not the run's .* under any prefix"):
        model.load_into(extra)
    with pytest.raises(ValueError, match=r"1 of the module's tensors are not in the run \(e.g. \['head.bias'\]\)"):
        model.load_into(extra, prefix="")
    untouched = [p.detach().clone() for p in extra.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(untouched, extra.parameters()))  # a refusal loads nothing


def test_the_prefix_is_where_the_module_s_tensors_are_exactly_the_run_s():
    names = ["model.a.weight", "model.b.weight", "other.c"]
    assert find_prefix(names, ["a.weight", "b.weight"]) == "model."
    assert find_prefix(names, ["model.a.weight", "model.b.weight", "other.c"]) == ""
    with pytest.raises(ValueError, match="under any prefix"):
        find_prefix(names, ["a.weight"])  # model.b.weight would be left out


def test_half_precision_module_gets_the_values_cast(shards):
    model = read_global_model(synchronizer=_address(shards), token=TOKEN)
    module = Model().to(torch.bfloat16)
    model.load_into(module)
    assert module.layer.weight.dtype == torch.bfloat16
    assert torch.equal(module.layer.weight, model.tensors()["layer.weight"].to(torch.bfloat16))


def test_export_before_any_island_joined_says_so(tmp_path):
    server = SynchronizerServer(Synchronizer(run_config()), token=TOKEN).start()
    try:
        with pytest.raises(ValueError, match="no island has joined this synchronizer yet: the run has no model to export"):
            read_global_model(synchronizer=server.address, token=TOKEN)
    finally:
        server.stop(grace=0)


def test_the_cli_refuses_a_config_the_model_does_not_fit_and_writes_nothing(shards, tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=16, hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                num_key_value_heads=1).save_pretrained(tmp_path / "llama")
    out = tmp_path / "out"
    for extra, said in [(["--hf-config", str(tmp_path / "llama")], "are not the run's"),
                        (["--hf-config", str(tmp_path / "nothing.json")], "no such file or folder"),
                        (["--prefix", "model."], "it needs --hf-config")]:
        with pytest.raises(SystemExit):
            main(["export", "--synchronizer", _address(shards), "--token", TOKEN, "--out", str(out), *extra])
        assert said in capsys.readouterr().err and not out.exists()


def test_a_compiled_or_checkpoint_wrapped_module_takes_the_global_model_by_its_plain_names(shards):
    """Users wrap what they trained (torch.compile adds _orig_mod., activation checkpointing
    _checkpoint_wrapped_module.): the global model loads into the wrapped module as into the plain one."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = read_global_model(synchronizer=_address(shards), token=TOKEN)
    wrapped = Model()
    wrapped.layer = checkpoint_wrapper(wrapped.layer)
    compiled = torch.compile(wrapped, backend="eager")
    assert any("_orig_mod." in n and "_checkpoint_wrapped_module." in n for n, _ in compiled.named_parameters())
    assert model.load_into(compiled) == ""
    assert torch.equal(wrapped.layer._checkpoint_wrapped_module.weight, model.tensors()["layer.weight"])
