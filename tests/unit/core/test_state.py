import json

import pytest
import torch

from lightning_diloco.core.config import MergeConfig, RunConfig, ScheduleConfig
from lightning_diloco.core.fragments import DENSE, TensorSpec, build_layout
from lightning_diloco.core.state import CHECKPOINT_NAME, SUMMARY_NAME, SynchronizerState, owned_by_shard


def _state(history=3, delta_vs_own_base=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    specs = [TensorSpec(name=f"t{i}", shape=(i + 2, 3), dtype="float32", role=DENSE) for i in range(6)]
    layout = build_layout(specs, 3)
    config = RunConfig(schedule=ScheduleConfig(num_fragments=3, sync_every=6),
                       merge=MergeConfig(history=history, delta_vs_own_base=delta_vs_own_base))
    params = [torch.randn(s.shape, generator=g) for s in specs]
    return SynchronizerState.from_parameters(config, layout, params)


def _advance(state, rounds, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        for p, frag in state.fragments.items():
            state.apply(p, torch.randn(frag.value.shape, generator=g))


def test_versions_count_outer_steps_and_history_keeps_the_last_s():
    state = _state(history=3)
    _advance(state, 5)
    assert state.versions() == {0: 5, 1: 5, 2: 5} and state.outer_steps == 15
    frag = state.fragments[0]
    assert sorted(frag.history) == [3, 4, 5]
    assert frag.base(2) is None and frag.base(6) is None
    assert torch.equal(frag.base(5), frag.value)


def test_outer_gradient_reconstructs_the_island_fragment():
    state = _state()
    frag = state.fragments[1]
    base = frag.value.clone()
    theta_m = base + 0.1
    _advance(state, 1)  # the global moved on since the island's base
    delta = frag.outer_gradient(0, theta_m - base)
    assert torch.allclose(delta, frag.value - theta_m, atol=1e-6)  # Theta_p - theta_m


def test_outer_gradient_against_own_base_when_asked():
    state = _state(delta_vs_own_base=True)
    frag = state.fragments[0]
    base = frag.value.clone()
    _advance(state, 1)
    assert torch.allclose(frag.outer_gradient(0, torch.full_like(base, 0.25)), torch.full_like(base, -0.25))


def test_checkpoint_round_trip_is_bit_exact(tmp_path):
    state = _state()
    _advance(state, 4)
    state.save(tmp_path)
    loaded = SynchronizerState.load(tmp_path)
    assert loaded.versions() == state.versions() and loaded.outer_steps == state.outer_steps
    assert loaded.layout.hash == state.layout.hash and loaded.config == state.config
    for p, frag in state.fragments.items():
        other = loaded.fragments[p]
        assert torch.equal(frag.value, other.value)
        assert frag.history.keys() == other.history.keys()
        assert all(torch.equal(frag.history[v], other.history[v]) for v in frag.history)
        assert torch.equal(frag.outer.momentum_buffer, other.outer.momentum_buffer)
    # and they keep evolving identically
    _advance(state, 2, seed=9)
    _advance(loaded, 2, seed=9)
    assert all(torch.equal(state.fragments[p].value, loaded.fragments[p].value) for p in state.fragments)


def test_checkpoint_loads_with_weights_only_and_has_a_readable_summary(tmp_path):
    state = _state()
    _advance(state, 2)
    path = state.save(tmp_path)
    torch.load(path, weights_only=True)
    summary = json.loads((tmp_path / SUMMARY_NAME).read_text())
    assert summary["versions"] == {"0": 2, "1": 2, "2": 2} and summary["layout_hash"] == state.layout.hash


def test_interrupted_write_never_replaces_a_good_checkpoint(tmp_path, monkeypatch):
    state = _state()
    state.save(tmp_path)
    good = (tmp_path / CHECKPOINT_NAME).read_bytes()
    _advance(state, 1)

    def crash_mid_write(obj, f):
        f.write(b"partial garbage")
        raise OSError("disk died")

    monkeypatch.setattr(torch, "save", crash_mid_write)
    with pytest.raises(OSError, match="disk died"):
        state.save(tmp_path)
    assert (tmp_path / CHECKPOINT_NAME).read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([CHECKPOINT_NAME, SUMMARY_NAME])  # no temp files left
    monkeypatch.undo()
    assert SynchronizerState.load(tmp_path).versions() == {0: 0, 1: 0, 2: 0}


def test_missing_checkpoint_loads_as_none(tmp_path):
    assert SynchronizerState.load(tmp_path) is None


def test_checkpoint_of_another_format_is_refused(tmp_path):
    state = _state()
    data = state.state_dict()
    data["format"] = 99
    with pytest.raises(ValueError, match="format 99"):
        SynchronizerState.from_state_dict(data)


def test_shards_own_disjoint_fragments():
    owned = [[p for p in range(7) if owned_by_shard(i, 3)(p)] for i in range(3)]
    assert owned == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match="shard index 3"):
        owned_by_shard(3, 3)
