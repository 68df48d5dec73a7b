import json

import pytest
import torch

from lightning_diloco.core.checkpoints import LATEST
from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.config import CodecConfig, MergeConfig, OuterConfig, RunConfig, ScheduleConfig
from lightning_diloco.core.fragments import DENSE, TensorSpec, build_layout
from lightning_diloco.core.outer import island_delta, outer_gradient
from lightning_diloco.core.state import FragmentState, SynchronizerState, owned_by_shard


def _state(history=3, seed=0, downlink="bf16"):
    g = torch.Generator().manual_seed(seed)
    specs = [TensorSpec(name=f"t{i}", shape=(i + 2, 3), dtype="float32", role=DENSE) for i in range(6)]
    layout = build_layout(specs, 3)
    config = RunConfig(schedule=ScheduleConfig(num_fragments=3, sync_every=6),
                       merge=MergeConfig(history=history), codec=CodecConfig(downlink=downlink))
    params = [torch.randn(s.shape, generator=g) for s in specs]
    return SynchronizerState.from_parameters(config, layout, params)


def _advance(state, rounds, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        for _p, frag in state.fragments.items():
            frag.apply(torch.randn(frag.value.shape, generator=g))


def _bases(updates):
    return [(u.version, u.base_version, u.codec) for u in updates]


def test_a_sparse_downlink_sends_the_fragments_of_the_named_tensors_in_int2():
    """``sparse_dense_tensors``: the fragment holding t1 goes down in int2, the others sparse,
    and a fragment made anew (a restart taking a version back) keeps its codec."""
    specs = [TensorSpec(name=f"t{i}", shape=(i + 2, 3), dtype="float32", role=DENSE) for i in range(6)]
    layout = build_layout(specs, 3)
    [named] = [p for p, members in enumerate(layout.fragments) if 1 in members]
    config = RunConfig(schedule=ScheduleConfig(num_fragments=3, sync_every=6),
                       codec=CodecConfig(downlink="sparse", sparse_density=1 / 8, sparse_dense_tensors="t1"))
    state = SynchronizerState.from_parameters(config, layout, [torch.randn(s.shape) for s in specs])
    _advance(state, 2)
    assert {p: frag.downlink(p, 1)[0].codec for p, frag in state.fragments.items()} == {
        p: "int2" if p == named else "sparse" for p in range(3)}
    state.fragments[named] = state.new_fragment(named, state.fragments[named].value, version=2)  # as a recovery does
    assert state.fragments[named].published.codec.name == "int2"


def test_versions_count_outer_steps_and_the_fp32_downlink_sends_the_exact_value_whole():
    state = _state(history=3, downlink="fp32")
    _advance(state, 5)
    assert state.versions() == {0: 5, 1: 5, 2: 5} and state.outer_steps == 15
    frag = state.fragments[0]
    assert sorted(frag.history) == [5] and frag.published is None  # fp32: one exact version, no second copy
    assert frag.downlink(0, 5) == []
    for have in (4, 3, 0, 6):  # one version behind, several, none kept, one never issued
        [update] = frag.downlink(0, have)
        assert _bases([update]) == [(5, -1, "fp32")]
        # bit for bit what the version log's digest is of: an island holding it can give it back
        assert torch.equal(get_codec("fp32").decode(update.payload, frag.value.numel()), frag.value)
    assert torch.equal(frag.published_value(), frag.value)


def test_a_lossy_downlink_keeps_the_current_version_and_the_steps_from_the_last_s():
    state = _state(history=3, downlink="int4")
    _advance(state, 5)
    frag = state.fragments[0]
    assert sorted(frag.history) == [5] and sorted(frag.published.steps) == [4, 5]
    assert _bases(frag.downlink(0, 3)) == [(4, 3, "int4"), (5, 4, "int4")]
    assert _bases(frag.downlink(0, 2)) == [(5, -1, "fp32")]
    assert torch.equal(frag.published_value(), frag.published.value)
    assert 0 < float((frag.published_value() - frag.value).abs().max()) < 0.5  # lossy, within a step of it


def test_outer_gradient_is_measured_against_the_islands_own_base_even_when_stale():
    """A late contribution adds its own progress only: it never undoes the rounds it missed."""
    state = _state()
    frag = state.fragments[0]
    base = frag.value.clone()
    _advance(state, 1)  # the global moved on since the island's base
    local = base + 0.25  # the island's progress since its base
    assert torch.allclose(outer_gradient(island_delta(local, base)), torch.full_like(base, -0.25))


def test_a_checkpoint_with_older_exact_versions_loads_its_current_one_only():
    """Checkpoints written while the fp32 downlink sent deltas kept the last S exact versions."""
    state = _state(history=2, downlink="fp32")
    _advance(state, 3)
    data = state.state_dict()
    frag = state.fragments[0]
    data["fragments"][0]["history"] = {2: frag.value - 1.0, 3: frag.value.clone()}
    loaded = SynchronizerState.from_state_dict(data).fragments[0]
    assert sorted(loaded.history) == [3] and torch.equal(loaded.value, frag.value)


@pytest.mark.parametrize("downlink", ["fp32", "int4"])
def test_checkpoint_round_trip_is_bit_exact(tmp_path, downlink):
    state = _state(downlink=downlink)
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
        # the chains go on: an island holding an older version is sent the same steps
        assert torch.equal(frag.published_value(), other.published_value())
        for have in range(5):
            assert [(u.base_version, u.payload.tolist()) for u in frag.downlink(0, have)] == \
                   [(u.base_version, u.payload.tolist()) for u in other.downlink(0, have)]
    # and they keep evolving identically
    _advance(state, 2, seed=9)
    _advance(loaded, 2, seed=9)
    assert all(torch.equal(state.fragments[p].value, loaded.fragments[p].value) for p in state.fragments)
    assert all(torch.equal(state.fragments[p].published_value(), loaded.fragments[p].published_value()) for p in state.fragments)


def test_a_checkpoint_written_before_published_chains_loads_and_islands_get_whole_values(tmp_path):
    state = _state(downlink="int4")
    _advance(state, 3)
    data = state.state_dict()
    for f in data["fragments"].values():
        del f["published"]  # as written before the chains
    loaded = SynchronizerState.from_state_dict(data)
    frag = loaded.fragments[0]
    assert frag.version == 3 and torch.equal(frag.value, state.fragments[0].value)
    # nobody is known to hold what it would build on: the value the chain starts from goes out whole
    assert _bases(frag.downlink(0, 2)) == [(3, -1, "fp32")]
    assert torch.equal(frag.published_value(), frag.value)
    _advance(loaded, 1)
    assert _bases(frag.downlink(0, 3)) == _bases(frag.downlink(0, 2)) == [(4, -1, "fp32")]
    _advance(loaded, 1)
    assert _bases(frag.downlink(0, 4)) == [(5, 4, "int4")]  # chains from the first value sent whole on


def test_checkpoint_loads_with_weights_only_and_has_a_readable_summary(tmp_path):
    state = _state()
    _advance(state, 2)
    path = state.save(tmp_path)
    torch.load(path, weights_only=True)
    summary = json.loads((tmp_path / LATEST).read_text())
    assert summary["checkpoint"] == path.name and len(summary["sha256"]) == 64
    assert summary["versions"] == {"0": 2, "1": 2, "2": 2} and summary["layout_hash"] == state.layout.hash


def test_interrupted_write_never_replaces_a_good_checkpoint(tmp_path, monkeypatch):
    state = _state()
    good_path = state.save(tmp_path)
    good = good_path.read_bytes()
    before = sorted(p.name for p in tmp_path.iterdir())
    _advance(state, 1)

    monkeypatch.setattr("os.fdopen", lambda *a, **k: (_ for _ in ()).throw(OSError("disk died")))
    with pytest.raises(OSError, match="disk died"):
        state.save(tmp_path)
    monkeypatch.undo()
    assert good_path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp files left
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


@pytest.mark.parametrize("downlink", ["int2", "bf16"])
def test_a_step_the_downlink_cannot_encode_is_not_taken(downlink):
    """A finite value the lossy downlink cannot carry (an int2 block whose rms rounds past fp32's
    largest level, from 2.27e38; bf16: values that round past its top) used to raise out of apply after the version
    had been counted but not published: the closer thread died with it, and every later step of the
    fragment failed on 'versions are published in order'. It is refused as a non-finite step is."""
    config = RunConfig(codec=CodecConfig(downlink=downlink), outer=OuterConfig(lr=1.0, momentum=0.0, nesterov=False))
    frag = FragmentState(torch.zeros(64), config)
    top = 2.5e38 if downlink == "int2" else 3.4e38  # finite in fp32; the step from 0 is this value
    assert frag.apply(torch.full((64,), -top)) is None
    assert frag.version == 0 and frag.published.version == 0 and torch.equal(frag.value, torch.zeros(64))
    assert frag.apply(torch.full((64,), -1.0)) == 1  # the fragment keeps stepping
    assert torch.equal(frag.value, torch.ones(64)) and frag.published.version == 1
    assert (frag.published.value - 1).abs().max() <= 0.5  # within one int2 step (rms 1: the level 1.5)
