"""The sparse codec (core/sparse_codec.py): exactly the top k of each chunk, its stated size, error
feedback that delivers what it leaves out, and every malformed payload refused with its reason.
(The conformance suite every codec runs is in test_codecs.py.)"""

import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.config import CodecConfig
from lightning_diloco.core.downlink import PublishedChain
from lightning_diloco.core.feedback import UplinkFeedback
from lightning_diloco.core.sparse_codec import CHUNK, SparseCodec
from tests.helpers import run_bounded, sparse_payload_indices, sparse_payload_with_indices

ROOT = Path(__file__).resolve().parents[2]


def _gaussian(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _sent(decoded: torch.Tensor) -> list[set[int]]:
    """The indices a decoded value holds something at, chunk by chunk."""
    return [set(chunk.nonzero().squeeze(1).tolist()) for chunk in decoded.split(CHUNK)]


def _sent_mask(x: torch.Tensor, density: float) -> torch.Tensor:
    mask = torch.zeros(x.numel(), dtype=torch.bool)
    for c, chunk in enumerate(_top(x, density)):
        mask[[c * CHUNK + i for i in chunk]] = True
    return mask


def _top(x: torch.Tensor, density: float) -> list[set[int]]:
    """The codec's rule written plainly: the k largest magnitudes of each chunk, ties to the lower index."""
    out = []
    for chunk in x.split(CHUNK):
        k = max(1, min(chunk.numel(), round(density * chunk.numel())))
        out.append(set(torch.sort(chunk.abs(), descending=True, stable=True).indices[:k].tolist()))
    return out


@pytest.mark.parametrize("density", [1 / 4096, 1 / 64, 1 / 8, 0.5])
@pytest.mark.parametrize("n", [5 * CHUNK + 1000, 3 * CHUNK, 300])
@pytest.mark.parametrize("size", [1.0, 1e-25])  # 1e-25: fp32 squares underflow, the rms is taken in float64
def test_each_chunk_sends_exactly_its_largest_values_at_the_level_of_their_rms(density, n, size):
    x = _gaussian(n, seed=n) * size
    codec = SparseCodec(density)
    out = codec.decode(codec.encode(x), n)
    assert _sent(out) == _top(x, density)
    for chunk, got in zip(x.split(CHUNK), out.split(CHUNK)):
        sent = got != 0
        rms = chunk[sent].double().square().mean().sqrt()
        ratio = got[sent] / rms  # one of +-0.5, +-1.5, the scale being rms rounded to bf16
        assert bool(((ratio.abs() - 0.5).abs() < 0.01).logical_or((ratio.abs() - 1.5).abs() < 0.01).all())
        assert bool((torch.sign(got[sent]) == torch.sign(chunk[sent])).all())


def test_size_is_two_bytes_a_chunk_plus_two_bits_and_twelve_bits_a_value_sent():
    codec = get_codec("sparse", density=1 / 64)
    assert codec.encoded_size(CHUNK) == 2 + 64 * 12 // 8 + 64 // 4 == 114
    assert codec.encoded_size(10 * CHUNK) == 1140
    # a tail of 1000 values sends round(1000/64) = 16 of them
    assert codec.encoded_size(10 * CHUNK + 1000) == 1140 + 2 + 24 + 4
    assert codec.encoded_size(CHUNK) * 19 < get_codec("int4").encoded_size(CHUNK)  # 19x fewer bytes than int4


def test_ties_and_a_stride_16_pattern_still_send_exactly_k():
    """Equal values tie at the threshold (every one a candidate); where the stride-16 sample holds
    a chunk's largest values, fewer than k reach its threshold and every value is a candidate."""
    codec = SparseCodec(1 / 64)
    ties = torch.ones(2 * CHUNK)
    out = codec.decode(codec.encode(ties), ties.numel())
    assert [len(s) for s in _sent(out)] == [64, 64]
    assert _sent(out) == [set(range(64))] * 2  # ties go to the lower index
    pattern = _gaussian(2 * CHUNK) * 0.01
    pattern[::16] += 5.0 * torch.arange(1, pattern[::16].numel() + 1) / pattern[::16].numel()
    out = codec.decode(codec.encode(pattern), pattern.numel())
    assert _sent(out) == _top(pattern, 1 / 64)


@pytest.mark.parametrize("density", [1 / 4096, 1 / 256, 1 / 64, 1 / 16, 1 / 8, 0.5])
def test_the_compiled_search_sends_what_the_rule_says_whatever_the_values(density):
    """The radix select narrows on the exponent, then on 8, 8 and 7 bits of the mantissa, among
    the values a stride-16 sample lets through: values tied at the threshold, equal but for
    their lowest bits, large only off the sample, subnormal, signed zeros or heavy-tailed must
    still send exactly the rule's values."""
    g = torch.Generator().manual_seed(int(1 / density))
    for trial in range(8):
        n = int(torch.randint(1, 4 * CHUNK, (1,), generator=g)) + CHUNK
        x = torch.randn(n, generator=g)
        if trial == 1:
            x = torch.randint(1, 4, (n,), generator=g).float()  # three magnitudes: ties everywhere
        elif trial == 2:
            x = 1.0 + torch.randint(0, 300, (n,), generator=g).float() * 2.0**-23  # one exponent, the low bits differ
        elif trial == 3:
            x[::16] *= 50.0  # the sample holds the largest values: fewer than k reach its threshold
        elif trial == 4:
            x[torch.rand(n, generator=g) < 0.9] = 0.0
            x[x == 0] = 1e-3  # a sent value that decodes to zero could not be seen
        elif trial == 5:
            x = x * 1e-40  # subnormal: the exponent's bucket is 0 for all of them
            x[::7] = -0.0
        elif trial == 6:
            x = x.pow(5)
        codec = SparseCodec(density)
        payload = codec.encode(x)
        assert sparse_payload_indices(payload, codec, n) == _top(x, density), trial
        assert torch.equal(codec.decode(payload, n) != 0, _sent_mask(x, density)), trial


def test_uplink_feedback_delivers_what_each_push_leaves_out():
    """At 1/64 a push carries 5% of a delta's norm; with feedback the sum received over 200 pushes
    is within 20% of the sum sent (without, 95% is lost every time)."""
    codec, g = get_codec("sparse", density=1 / 64), torch.Generator().manual_seed(0)
    feedback = UplinkFeedback(codec)
    drift = torch.randn(4096, generator=g)
    sent, received, alone = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096)
    for _ in range(200):
        delta = drift + 0.3 * torch.randn(4096, generator=g)
        sent += delta
        received += codec.decode(feedback.encode(0, delta), 4096)
        alone += codec.decode(codec.encode(delta), 4096)
    assert float((sent - received).norm() / sent.norm()) < 0.2
    assert float((sent - alone).norm() / sent.norm()) > 0.9


def test_downlink_chain_reaches_a_dense_global_value_a_sparse_step_at_a_time():
    """The merged update of several islands is dense: each published step carries its largest
    part, and the published value an island holds closes on the global one version by version."""
    codec = get_codec("sparse", density=1 / 64)
    start = _gaussian(3 * CHUNK, seed=1)
    chain = PublishedChain(start, 0, codec, depth=4)
    target = start + 0.01 * _gaussian(3 * CHUNK, seed=2)  # a dense change
    errors = []
    for version in range(1, 101):
        chain.advance(target, version)
        errors.append(float((chain.value - target).norm() / (target - start).norm()))
    assert errors[0] > 0.9 and errors[-1] < 0.25 and errors[-1] < errors[49] < errors[9]


def test_hostile_payloads_are_refused_naming_what_is_wrong():
    codec, n = SparseCodec(1 / 64), CHUNK + 1000  # a full chunk of k = 64 and a tail of 1000 values, k = 16
    payload = codec.encode(_gaussian(n))
    full = list(range(0, 640, 10))
    tail = list(range(0, 160, 10))
    well_formed = codec.decode(sparse_payload_with_indices(payload, codec, n, full + tail), n)
    assert _sent(well_formed) == [set(full), set(tail)]
    duplicate = full[:10] + [full[10]] + full[10:-1]
    with pytest.raises(ValueError, match="not strictly ascending within a chunk"):
        codec.decode(sparse_payload_with_indices(payload, codec, n, duplicate + tail), n)
    with pytest.raises(ValueError, match="not strictly ascending within its last chunk"):
        codec.decode(sparse_payload_with_indices(payload, codec, n, full + tail[::-1]), n)
    with pytest.raises(ValueError, match="index 1000 past its last chunk of 1000 values"):
        codec.decode(sparse_payload_with_indices(payload, codec, n, full + tail[:-1] + [1000]), n)
    denser = SparseCodec(1 / 32).encode(_gaussian(n))  # a density above the setting
    with pytest.raises(ValueError, match="does not match"):
        codec.decode(denser, n)
    bad_scale = payload.clone()
    bad_scale[:2].view(torch.bfloat16).fill_(float("inf"))
    with pytest.raises(ValueError, match="non-finite"):
        codec.decode(bad_scale, n)
    odd = SparseCodec(1 / 64)
    m = 3 * 64  # 3 values sent: an odd count pads its indices with a zero one, and its levels
    padded = odd.encode(_gaussian(m))
    padded[-1] |= 0b11000000  # the fourth level of the last byte: padding
    with pytest.raises(ValueError, match="padding levels are not zero"):
        odd.decode(padded, m)


def _python(code: str, timeout: float, **env: str) -> list[str]:
    """The lines ``python -c code`` prints, run from the repository's root in a process of its own."""
    done = run_bounded([sys.executable, "-c", code], timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout.splitlines()


def fuzz_decode(trials: int) -> tuple[int, int]:
    """Random payloads, and honest ones with bytes overwritten at random: each decodes to finite
    values, at most k a chunk, or is refused with a ValueError. Returns (refused, decoded)."""
    g = torch.Generator().manual_seed(0)
    refused = decoded = 0
    for trial in range(trials):
        density = [1 / 4096, 1 / 64, 1 / 8, 0.5][trial % 4]
        n = int(torch.randint(1, 3 * CHUNK, (1,), generator=g))
        codec = SparseCodec(density)
        if trial % 2:
            payload = torch.randint(0, 256, (codec.encoded_size(n),), dtype=torch.uint8, generator=g)
        else:
            payload = codec.encode(_gaussian(n, seed=trial))
            where = torch.randint(0, payload.numel(), (3,), generator=g)
            payload[where] = torch.randint(0, 256, (3,), dtype=torch.uint8, generator=g)
        try:
            out = codec.decode(bytes(payload.numpy()), n)
        except ValueError:
            refused += 1
            continue
        decoded += 1
        assert out.shape == (n,) and bool(torch.isfinite(out).all())
        assert all(len(sent) <= max(1, round(density * CHUNK)) for sent in _sent(out))
    return refused, decoded


@pytest.mark.timeout(180)
def test_any_payload_of_the_right_size_decodes_to_finite_values_or_is_refused(tmp_path):
    """The decoder is compiled without bounds checks, so every byte it reads or writes must follow
    from the sizes it checked. Here it is compiled with them (NUMBA_BOUNDSCHECK, in a process and
    a cache of its own), so a read or write out of place fails the run instead of passing unseen."""
    out = _python("from tests.core.test_sparse_codec import fuzz_decode; print(*fuzz_decode(400))", timeout=150,
                  NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path))
    refused, decoded = map(int, out[-1].split())
    assert refused > 20 and decoded > 20, (refused, decoded)  # both paths taken (351 and 49 here)


@pytest.mark.timeout(120)
def test_a_sparse_run_s_synchronizer_has_the_kernels_as_it_starts_and_another_run_never_loads_numba():
    """Compiled at the first merge or push instead, the kernels cost four islands starting together
    11 s of rounds (2026-11-29); a run on the other codecs does not pay numba's import at all."""
    code = """if True:
        import sys
        from lightning_diloco.core.state import SynchronizerState
        from tests.helpers import initial_fragments, layout, run_config
        for codec in ("int4", "sparse"):
            config = run_config(uplink=codec, downlink=codec)
            SynchronizerState(config, layout(config), initial_fragments(config))
            if "numba" not in sys.modules:
                print(codec, "no numba")
                continue
            from lightning_diloco.core import sparse_kernels
            print(codec, len(sparse_kernels.encode_into.signatures), len(sparse_kernels.decode_into.signatures))
    """
    assert _python(code, timeout=100)[-2:] == ["int4 no numba", "sparse 1 1"]


def test_density_setting_is_validated_and_sparse_uplink_needs_feedback():
    assert CodecConfig(uplink="sparse", downlink="sparse", sparse_density=1 / 128).sparse_density == 1 / 128
    for bad in (0, 1 / 8192, 0.75, True, "0.01"):
        with pytest.raises(ValueError, match="sparse_density"):
            CodecConfig(sparse_density=bad)
    with pytest.raises(ValueError, match="needs uplink_feedback=True"):
        CodecConfig(uplink="sparse", uplink_feedback=False)
    with pytest.raises(ValueError, match="density"):
        SparseCodec(0.9)


def test_dense_tensors_setting_is_for_the_sparse_uplink_and_has_no_empty_pattern():
    assert CodecConfig(uplink="sparse", sparse_dense_tensors="lm_head.*").sparse_dense_tensors == "lm_head.*"
    assert CodecConfig(downlink="sparse", sparse_dense_tensors="lm_head.*").downlink == "sparse"
    with pytest.raises(ValueError, match="applies to a sparse codec only, and the codecs are 'int4' up and 'int4' down"):
        CodecConfig(sparse_dense_tensors="lm_head.*")
    with pytest.raises(ValueError, match="has an empty pattern"):
        CodecConfig(uplink="sparse", sparse_dense_tensors="lm_head.*,,embed")


def test_the_sparse_preset_sends_sparse_both_ways_with_feedback_and_keeps_the_base_otherwise():
    from lightning_diloco.core import presets
    from lightning_diloco.core.config import RunConfig

    config = presets.sparse(density=1 / 128)
    assert (config.codec.uplink, config.codec.downlink, config.codec.sparse_density) == ("sparse", "sparse", 1 / 128)
    assert config.codec.uplink_feedback and config.outer == RunConfig().outer and config.schedule == RunConfig().schedule
    assert config.codec.uplink_residual == "push"  # the parameters only where a user asks (core/config.py)
    assert RunConfig.from_dict(config.to_dict()) == config  # what a synchronizer hands an island on join
