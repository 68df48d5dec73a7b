"""The published chain (core/downlink.py): with a lossy downlink an island's copy stays within one
quantisation step of the global model, where deltas of exact global values let it drift."""

from __future__ import annotations

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.downlink import PublishedChain

NUMEL, VERSIONS = 4096, 200


def _global_walk(seed=0):
    """Version 0 and the next VERSIONS global values: outer steps of about 1% of the weights,
    partly the same direction every time (a trend), partly noise."""
    g = torch.Generator().manual_seed(seed)
    value = torch.randn(NUMEL, generator=g)
    trend = 0.005 * torch.randn(NUMEL, generator=g)
    values = [value]
    for _ in range(VERSIONS):
        value = value + trend + 0.01 * torch.randn(NUMEL, generator=g)
        values.append(value)
    return values


def _apply(held: torch.Tensor, update) -> torch.Tensor:
    """What an island does with one message (learner/island.py ``_apply``)."""
    decoded = get_codec(update.codec).decode(update.payload, NUMEL)
    return decoded if update.base_version < 0 else held + decoded


def _quant_bound(codec, x: torch.Tensor) -> torch.Tensor:
    """The codec's documented per-element error bound for input ``x`` (core/codecs.py)."""
    if codec.name == "bf16":
        return 2.0**-8 * x.abs()
    absmax = x.view(-1, codec.block_size).abs().amax(dim=1, keepdim=True).expand(-1, codec.block_size).reshape(-1)
    return (1 + 2.0**-8) / 2 * absmax / codec.top


@pytest.mark.parametrize("name", ["int4", "bf16"])
def test_an_island_holds_the_published_value_which_stays_one_quantisation_step_from_the_global(name):
    codec = get_codec(name)
    values = _global_walk()
    chain = PublishedChain(values[0], 0, codec, depth=4)
    island = values[0].clone()  # what it pulled: the seed, exact
    old_scheme = values[0].clone()  # deltas of exact global values, as sent before the chain
    errors = []
    for v in range(1, VERSIONS + 1):
        step_input = values[v] - chain.value
        chain.advance(values[v], v)
        [update] = chain.updates(0, v - 1)
        island = _apply(island, update)
        assert torch.equal(island, chain.value)  # one step at a time: bit for bit what the synchronizer holds
        error = (values[v] - chain.value).abs()
        assert bool((error <= _quant_bound(codec, step_input) * (1 + 1e-5) + 1e-6).all()), f"version {v}"
        errors.append(float(error.max()))
        old_scheme = old_scheme + codec.decode(codec.encode(values[v] - values[v - 1]), NUMEL)
    # bounded: the last versions' error is no larger than the first ones' (no growth with v)
    assert max(errors[-20:]) < 1.5 * max(errors[:20]), (errors[:20], errors[-20:])
    new_error = float((values[-1] - island).abs().mean())
    old_error = float((values[-1] - old_scheme).abs().mean())
    assert new_error * 5 < old_error, (new_error, old_error)  # the old copy drifted (a random walk, ~sqrt(v))


def test_int2_published_value_stays_near_the_global_without_drift():
    """int2 has no per-element bound (core/codecs.py): the error is bounded over versions instead."""
    codec = get_codec("int2")
    values = _global_walk()
    chain = PublishedChain(values[0], 0, codec, depth=4)
    island, old_scheme, errors = values[0].clone(), values[0].clone(), []
    for v in range(1, VERSIONS + 1):
        chain.advance(values[v], v)
        [update] = chain.updates(0, v - 1)
        island = _apply(island, update)
        assert torch.equal(island, chain.value)
        errors.append(float((values[v] - island).norm()))
        old_scheme = old_scheme + codec.decode(codec.encode(values[v] - values[v - 1]), NUMEL)
    step = float((values[2] - values[1]).norm())
    assert max(errors[-20:]) < 1.5 * max(errors[:20]) and max(errors) < step, (errors[:20], errors[-20:], step)
    assert errors[-1] * 5 < float((values[-1] - old_scheme).norm())


def test_an_island_several_versions_behind_gets_the_steps_since_in_order_and_lands_on_the_published_value():
    codec = get_codec("int4")
    values = _global_walk()[:8]
    chain = PublishedChain(values[0], 0, codec, depth=4)
    held = {}
    for v in range(1, 8):
        held[v - 1] = chain.value
        chain.advance(values[v], v)
    updates = chain.updates(0, 4)
    assert [(u.version, u.base_version, u.codec) for u in updates] == [(5, 4, "int4"), (6, 5, "int4"), (7, 6, "int4")]
    island = held[4]
    for u in updates:
        island = _apply(island, u)
    assert torch.equal(island, chain.value)
    # summed first, then added (the inbox's order before it kept steps apart): fp32 rounding apart
    summed = sum(get_codec("int4").decode(u.payload, NUMEL) for u in updates)
    assert torch.allclose(held[4] + summed, chain.value, rtol=0, atol=4 * torch.finfo(torch.float32).eps * float(chain.value.abs().max()))
    assert chain.updates(0, 7) == []


def test_a_version_no_longer_kept_or_a_chain_dearer_than_the_whole_value_is_sent_whole():
    values = _global_walk()[:8]
    int4 = PublishedChain(values[0], 0, get_codec("int4"), depth=4)
    bf16 = PublishedChain(values[0], 0, get_codec("bf16"), depth=8)
    for v in range(1, 8):
        int4.advance(values[v], v)
        bf16.advance(values[v], v)
    for chain, have in [(int4, 3), (int4, 0), (int4, 9), (int4, -1), (bf16, 4)]:  # bf16: 3 steps of 2 B > 4 B
        [update] = chain.updates(0, have)
        assert (update.version, update.base_version, update.codec) == (7, -1, "fp32"), have
        assert torch.equal(get_codec("fp32").decode(update.payload, NUMEL), chain.value)  # the published value, not the global
    assert not torch.equal(int4.value, values[7])
    assert [u.base_version for u in bf16.updates(0, 5)] == [5, 6]  # 2 steps of 2 B: no more than whole
