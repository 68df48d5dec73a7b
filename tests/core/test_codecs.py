"""Every codec runs one conformance suite; quantized codecs also meet their stated error bound."""

import math
import threading

import pytest
import torch

from lightning_diloco.core import codecs
from lightning_diloco.core.codecs import BlockQuantCodec, get_codec

CODECS = ["fp32", "bf16", "int8", "int4", "int2", "sparse"]


def _gaussian(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4097])
def test_round_trip_has_exact_byte_count_and_shape(name, n):
    codec = get_codec(name)
    data = codec.encode(_gaussian(n))
    assert data.dtype == torch.uint8 and data.numel() == codec.encoded_size(n)
    out = codec.decode(data, n)
    assert out.shape == (n,) and out.dtype == torch.float32
    assert torch.equal(codec.decode(data.numpy().tobytes(), n), out)  # bytes off the wire decode alike


@pytest.mark.parametrize("name", CODECS)
def test_empty_tensor_encodes_to_nothing(name):
    codec = get_codec(name)
    assert codec.encode(torch.zeros(0)).numel() == 0
    assert codec.decode(b"", 0).numel() == 0


@pytest.mark.parametrize("name", CODECS)
def test_zeros_decode_to_exact_zeros(name):
    codec = get_codec(name)
    assert torch.equal(codec.decode(codec.encode(torch.zeros(300)), 300), torch.zeros(300))


@pytest.mark.parametrize("name", CODECS)
def test_non_contiguous_input_matches_its_contiguous_copy(name):
    codec = get_codec(name)
    x = _gaussian(200 * 3).view(200, 3).t()  # transposed: not contiguous
    assert not x.is_contiguous()
    assert torch.equal(codec.encode(x), codec.encode(x.contiguous()))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_refused(name, bad):
    x = _gaussian(100)
    x[37] = bad
    with pytest.raises(ValueError, match="non-finite"):
        get_codec(name).encode(x)


@pytest.mark.parametrize("name", CODECS)
def test_payload_of_wrong_size_is_refused(name):
    codec = get_codec(name)
    data = codec.encode(_gaussian(128))
    with pytest.raises(ValueError, match="does not match"):
        codec.decode(data[:-1], 128)
    with pytest.raises(ValueError, match="does not match"):
        codec.decode(data.numpy().tobytes()[:-1], 128)
    with pytest.raises(ValueError, match="does not match"):
        codec.decode(data, 129 if name in ("fp32", "bf16") else 1000)


def test_fp32_is_exact():
    x = _gaussian(1000)
    assert torch.equal(get_codec("fp32").decode(get_codec("fp32").encode(x), 1000), x)


def test_bf16_relative_error_is_at_most_2_to_minus_8():
    x = _gaussian(10000) * 1e3
    out = get_codec("bf16").decode(get_codec("bf16").encode(x), x.numel())
    assert bool(((x - out).abs() <= 2**-8 * x.abs()).all())


@pytest.mark.parametrize("bits,block", [(8, 64), (4, 64), (4, 128), (8, 16)])
def test_block_quant_error_bound_per_element(bits, block):
    """|x - x'| <= (1 + 2**-8) / 2 * absmax(block) / q, q = 2**(bits-1) - 1."""
    codec = get_codec(f"int{bits}", block)
    # blocks of very different magnitudes, so a shared scale would fail the bound
    x = _gaussian(block * 50 + 7) * torch.logspace(-6, 3, block * 50 + 7)
    out = codec.decode(codec.encode(x), x.numel())
    q = 2 ** (bits - 1) - 1
    padded = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    bound = (padded.abs().amax(dim=1) * (1 + 2**-8) / 2 / q).repeat_interleave(block)[: x.numel()]
    assert bool(((x - out).abs() <= bound * (1 + 1e-6)).all())


@pytest.mark.parametrize("name,max_bytes,max_rel_rms", [("int8", 1.1, 0.01), ("int4", 0.56, 0.12),
                                                              ("int2", 0.29, 0.36)])
def test_quantized_codecs_meet_bytes_and_error_aims_on_gaussian_data(name, max_bytes, max_rel_rms):
    codec = get_codec(name)
    x = _gaussian(1 << 16)
    out = codec.decode(codec.encode(x), x.numel())
    rel_rms = float((x - out).norm() / x.norm())
    assert codec.encode(x).numel() / x.numel() <= max_bytes
    assert rel_rms <= max_rel_rms


def test_corrupt_scale_is_refused_on_decode():
    codec = get_codec("int4")
    data = bytearray(codec.encode(_gaussian(64)).numpy().tobytes())
    data[0:2] = torch.tensor([float("inf")], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    with pytest.raises(ValueError, match="non-finite"):
        codec.decode(bytes(data), 64)


def test_unknown_codec_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="fp32, bf16, int8, int4, int2"):
        get_codec("int3")


def test_int2_uses_all_four_levels_and_packs_four_values_a_byte():
    codec = get_codec("int2", 8)
    x = torch.tensor([-1.5, -0.5, 0.5, 1.25, 3.0, -1.0, 0.1, -0.1])  # rms 1.3385
    s = float(x.pow(2).mean().sqrt().to(torch.bfloat16))
    payload = codec.encode(x)
    assert payload.numel() == 2 + 2  # one bf16 scale, 8 values in 2 bytes
    assert codec.decode(payload, 8).tolist() == [k * s for k in (-1.5, -0.5, 0.5, 0.5, 1.5, -0.5, 0.5, -0.5)]
    assert payload[2:].tolist() == [0b10_10_01_00, 0b01_10_01_11]  # k + 2, lowest bits first


def _block_rms(x, block):
    """Each value's block rms, the tail block's over its own values."""
    sums = torch.nn.functional.pad(x.double().pow(2), (0, -x.numel() % block)).view(-1, block).sum(dim=1)
    counts = torch.full_like(sums, block)
    counts[-1] = x.numel() - block * (len(sums) - 1)
    return (sums / counts).sqrt().float().repeat_interleave(block)[: x.numel()]


@pytest.mark.parametrize("numel", [1, 3, 5, 63, 65])
def test_int2_short_fragment_and_tail_block_keep_the_bound(numel):
    """A fragment shorter than a block (or a block's tail) is scaled by its own values' rms: the
    zero padding once shrank the scale, so a 1-value fragment went out as 0.19 of itself."""
    codec = get_codec("int2", 64)
    for seed in range(20):
        x = _gaussian(numel + seed)[seed:]
        out = codec.decode(codec.encode(x), numel)
        rms = _block_rms(x, 64)
        inside = x.abs() <= 2 * rms * (1 - 2**-7)
        assert bool(((x - out).abs()[inside] <= rms[inside] * (1 + 2**-8) / 2 * (1 + 1e-5)).all()), (seed, x, out)


@pytest.mark.parametrize("block", [8, 64, 128])
def test_int2_error_bound_within_two_rms_and_clipping_beyond(block):
    """|x - x'| <= (1 + 2**-8) / 2 * rms(block) where |x| <= 2 rms; beyond, x' = +-1.5 rms."""
    codec = get_codec("int2", block)
    x = _gaussian(block * 50 + 4) * torch.logspace(-6, 3, block * 50 + 4)
    out = codec.decode(codec.encode(x), x.numel())
    rms = _block_rms(x, block)
    inside = x.abs() <= 2 * rms * (1 - 2**-7)
    assert bool(((x - out).abs()[inside] <= rms[inside] * (1 + 2**-8) / 2 * (1 + 1e-5)).all())
    outside = ~inside & (x.abs() > 2 * rms * (1 + 2**-7))
    assert outside.any()
    assert torch.allclose(out[outside].abs(), 1.5 * rms[outside], rtol=2**-7)


def test_int2_scale_of_huge_finite_values_does_not_overflow():
    # a constant block: every value is its rms, decoded as 0.5 or 1.5 rms (the bf16 scale's rounding decides)
    for block, value in ((64, 1e38), (4096, 1e18)):  # 4096 squares of 1e18 overflow fp32 too
        codec = get_codec("int2", block)
        out = codec.decode(codec.encode(torch.full((block,), value)), block)
        assert bool(torch.isfinite(out).all()) and bool(((out - value).abs() <= value / 2 * (1 + 2**-7)).all())
    codec = get_codec("int2")
    with pytest.raises(ValueError, match="int2 input's largest level"):  # 1.5 rms past fp32: refused on encode
        codec.encode(torch.full((64,), 3e38))


def test_int4_size_formula():
    codec = get_codec("int4", 64)
    assert codec.encoded_size(64 * 10) == 10 * 2 + 10 * 32
    assert math.isclose(codec.encoded_size(64 * 1000) / (64 * 1000), 0.53125)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_a_float64_default_dtype_changes_nothing(name):
    """A caller that set torch's default dtype to float64 (common in scientific code) gets the
    same payload as everyone else: the tail block once followed the default dtype, and int2
    refused every fragment whose size is not a multiple of the block."""
    codec = get_codec(name)
    x = _gaussian(100)
    expected = codec.encode(x)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        payload = codec.encode(x)
        out = codec.decode(payload, 100)
    finally:
        torch.set_default_dtype(previous)
    assert torch.equal(payload, expected)
    assert out.dtype == torch.float32 and torch.equal(out, codec.decode(expected, 100))


@pytest.mark.parametrize("name", CODECS)
def test_a_thread_whose_default_device_is_another_gets_cpu_payloads_and_values(name):
    """Torch's default device is the calling thread's: a caller that set it (to a GPU, or to
    meta while building a model) still gets CPU payloads and values from CPU input (meta
    tensors have no data: before, a decode under it returned garbage)."""
    codec = get_codec(name)
    x = _gaussian(100)
    expected = codec.encode(x)
    with torch.device("meta"):
        payload = codec.encode(x)
        out = codec.decode(expected, 100)
    assert payload.device.type == "cpu" and torch.equal(payload, expected)
    assert out.device.type == "cpu" and torch.equal(out, codec.decode(expected, 100))


def test_a_thread_that_only_decodes_keeps_one_byte_per_chunk_value():
    """Decoding runs on the synchronizer's gRPC workers (up to 256 threads that live as long as
    the server): each keeps its scratch, so a decode must keep only the levels it uses, not the
    encoder's fp32 values too (1.25 MB a worker, 320 MB for a full pool, before this)."""

    codec = get_codec("int2")
    numel = 4 * codecs.BlockQuantCodec.chunk_values  # a body of chunk_values bytes: the most one decode keeps
    payload = codec.encode(_gaussian(numel))
    held = []

    def worker():
        codec.decode(payload, numel)
        held.append(sum(t.numel() * t.element_size() for t in vars(codecs._scratch).values() if isinstance(t, torch.Tensor)))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=60)
    assert held == [codecs.BlockQuantCodec.chunk_values]


def _reference_block_encode(x, bits, block):
    """The block codecs' layout the plain way: the whole input padded, fresh buffers, no chunks."""
    flat = x.detach().reshape(-1).to(torch.float32)
    nblocks = math.ceil(flat.numel() / block)
    blocks = torch.nn.functional.pad(flat, (0, nblocks * block - flat.numel())).view(nblocks, block)
    top = 1.5 if bits == 2 else 2 ** (bits - 1) - 1
    if bits == 2:
        counts = torch.full((nblocks,), float(block))
        counts[-1] = flat.numel() - block * (nblocks - 1)
        wide = torch.float64 if float(blocks.abs().max()) ** 2 * block > 1e38 else torch.float32  # squares past fp32
        scale = torch.linalg.vector_norm(blocks, dim=1, dtype=wide) / counts.sqrt()
    else:
        scale = blocks.abs().amax(dim=1) / top
    scale = scale.to(torch.bfloat16)
    divisor = scale.float().where(scale.float() > 0, torch.tensor(1.0))
    q = blocks / divisor[:, None]
    levels = (q.floor().clamp(-2, 1) + 2) if bits == 2 else (q.round().clamp(-top, top) + (8 if bits == 4 else 0))
    levels = levels.reshape(-1).to(torch.int64)
    if bits == 8:
        body = levels.to(torch.int8).view(torch.uint8)
    else:
        per_byte = 8 // bits
        columns = levels.view(-1, per_byte)
        body = sum(columns[:, k] << (bits * k) for k in range(per_byte)).to(torch.uint8)
    return scale, body


def _assert_matches_reference(payload, x, bits, block):
    scale, body = _reference_block_encode(x, bits, block)
    got_scale = payload[: scale.numel() * 2].view(torch.bfloat16)
    # an all-zero block's scale may be +0 or -0 (the max of 0 and -0): both decode to zeros
    assert torch.equal(got_scale.float(), scale.float()), (bits, block, x.numel())
    assert torch.equal(payload[scale.numel() * 2 :], body), (bits, block, x.numel())


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_block_codecs_match_a_plain_reference_byte_for_byte_at_every_edge(bits):
    """Whole blocks read in place, the tail padded alone, chunks through reused per-thread
    buffers: the same bytes as padding everything into fresh memory, at the sizes where chunks
    and blocks meet, for inputs that are views, strided, or of another dtype."""

    chunk = BlockQuantCodec.chunk_values
    for block in (4, 12, 64, 1000):
        codec = BlockQuantCodec(bits, block)
        for n in sorted({1, 3, block - 1, block, block + 1, chunk - 1, chunk, chunk + 1, 2 * chunk + block + 1}):
            x = _gaussian(n, seed=n) * 3
            _assert_matches_reference(codec.encode(x), x, bits, block)
    codec = BlockQuantCodec(bits, 64)
    base = _gaussian(3 * chunk + 77)
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 1e-30, 7.0, -1e38]).repeat(40)
    for x in (base[1::3], base[5 : 5 + chunk + 3], base[: 2 * chunk].view(2, -1).t(), base[:999].to(torch.bfloat16),
              base[:999].double(), (base[:999] * 50).to(torch.int32), torch.tensor(2.5).expand(999), special, torch.zeros(130)):
        _assert_matches_reference(codec.encode(x), x, bits, 64)


def test_block_codecs_on_many_threads_give_one_thread_s_bytes():
    """Each thread's scratch is its own: 8 threads encoding and decoding at once, codecs and sizes
    mixed, give exactly what one thread gives, and a decode between encodes changes nothing."""
    from concurrent.futures import ThreadPoolExecutor


    chunk = BlockQuantCodec.chunk_values

    def work(i):
        results = []
        for k in range(4):
            codec = get_codec(("int8", "int4", "int2")[(i + k) % 3], (8, 64, 128)[k % 3])
            n = (1, 63, chunk + 1, 2 * chunk - 5, 777)[(i + k) % 5]
            payload = codec.encode(_gaussian(n, seed=i * 10 + k))
            results.append((payload, codec.decode(payload, n)))
        return results

    alone = [work(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(work, range(8)))
    for one, other in zip(alone, together):
        for (p1, d1), (p2, d2) in zip(one, other):
            assert torch.equal(p1, p2) and torch.equal(d1, d2)


@pytest.mark.parametrize("name", CODECS)
def test_a_payload_viewed_at_any_offset_of_a_larger_byte_tensor_decodes(name):
    """Payloads kept side by side in one uint8 tensor, each decoded from its slice: an offset
    that is no multiple of 4 (fp32) or 2 (bf16 scales) once raised "storage_offset() must be
    divisible by 4 to view Byte as Float"."""
    codec = get_codec(name)
    payload = codec.encode(_gaussian(130))
    expected = codec.decode(payload, 130)
    for offset in (1, 2, 3, 5):
        packed = torch.cat([torch.zeros(offset, dtype=torch.uint8), payload])
        assert torch.equal(codec.decode(packed[offset:], 130), expected), offset
        assert torch.equal(packed[offset:], payload)  # read, never written


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("first", ["encode", "decode"])
def test_a_thread_s_first_call_inside_inference_mode_leaves_later_calls_working(name, first):
    """Each thread keeps its scratch buffers. One first made under ``torch.inference_mode()``
    (Lightning validates under it; so may a user's evaluation script) was an inference tensor,
    and every later encode on that thread outside inference mode raised "Inplace update to
    inference tensor outside InferenceMode is not allowed"."""
    codec = get_codec(name)
    x, big = _gaussian(1000), _gaussian(1 << 20)  # big: a decode that takes all the levels an encode of x needs
    expected, big_payload = codec.encode(x), codec.encode(big)
    outcome = {}

    def worker():
        try:
            with torch.inference_mode():
                outcome["inside"] = codec.encode(x) if first == "encode" else codec.decode(big_payload, big.numel())
            outcome["payload"], outcome["values"] = codec.encode(x), codec.decode(expected, 1000)
            with torch.inference_mode():  # and back inside, on the same buffers
                outcome["again"] = codec.encode(x)
        except RuntimeError as err:
            outcome["error"] = err

    thread = threading.Thread(target=worker)  # a fresh thread: fresh scratch
    thread.start()
    thread.join(timeout=60)
    assert "error" not in outcome, outcome.get("error")
    assert torch.equal(outcome["payload"], expected) and torch.equal(outcome["again"], expected)
    assert torch.equal(outcome["values"], codec.decode(expected, 1000))
