import torch

from benchmarks import codec_error


def test_a_rotation_keeps_the_error_of_what_it_rotates_and_helps_where_one_value_dominates_a_block():
    gaussian = torch.randn(64 * 500, generator=torch.Generator().manual_seed(0))
    plain = codec_error.errors(gaussian)
    # orthonormal: on Gaussian blocks the rotated error is int2's own (about 0.34)
    assert abs(plain["int2/64 rotated"] - plain["int2/64"]) < 0.02 and 0.3 < plain["int2/64"] < 0.38
    spiky = torch.zeros(64 * 500)
    spiky[::64] = 1.0  # one value per block: int2 clips it to 1.5 rms, a rotation spreads it
    spiky += 1e-3 * torch.randn(spiky.numel(), generator=torch.Generator().manual_seed(1))
    errors = codec_error.errors(spiky)
    assert errors["int2/64 rotated"] < 0.6 * errors["int2/64"]  # 0.49 against 0.95


def test_outer_gradients_are_the_models_change_over_h_steps():
    gradients = codec_error.outer_gradients(sync_every=2, starts=[0, 3])
    assert sorted(gradients) == [0, 3]
    first = gradients[0]
    assert first.dim() == 1 and first.numel() > 100_000 and 0 < float(first.norm()) < float("inf")
    assert not torch.equal(gradients[0], gradients[3])
