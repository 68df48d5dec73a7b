"""Uplink error feedback: what the synchronizer receives adds up to what the island sent."""

import threading

import pytest
import torch

from lightning_diloco.core.codecs import get_codec
from lightning_diloco.core.feedback import UplinkFeedback


def _deltas(rounds, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    drift = torch.randn(n, generator=g) * 0.01  # a consistent direction under the noise, as training has
    return [drift + torch.randn(n, generator=g) * 0.01 for _ in range(rounds)]


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_received_progress_tracks_the_sum_of_deltas_within_a_message_error(name):
    codec = get_codec(name)
    deltas = _deltas(200, 4096)
    feedback = UplinkFeedback(codec)
    with_feedback = sum(codec.decode(feedback.encode(3, d), d.numel()) for d in deltas)
    without = sum(codec.decode(codec.encode(d), d.numel()) for d in deltas)
    total = sum(deltas)
    one_message = float((deltas[0] - codec.decode(codec.encode(deltas[0]), 4096)).norm())
    # what was sent, added up, is off by exactly the residual still held back, which stays at the
    # size of a message's error (about 2x for int2, whose messages carry delta + residual)
    assert torch.allclose(total - with_feedback, feedback.residual[3], atol=1e-4)
    assert float((total - with_feedback).norm()) < 3 * one_message
    # without feedback the error is a random walk over the rounds (about sqrt(200) messages' worth)
    assert float((total - without).norm()) > 5 * float((total - with_feedback).norm())


def test_deltas_are_not_changed_and_fragments_keep_their_own_residuals():
    feedback = UplinkFeedback(get_codec("int2"))
    a, b = _deltas(2, 256)
    a_copy = a.clone()
    feedback.encode(0, a)
    assert torch.equal(a, a_copy)
    feedback.encode(1, b)
    assert set(feedback.residual) == {0, 1}
    assert not torch.equal(feedback.residual[0], feedback.residual[1])


def test_a_fragment_of_another_size_starts_without_a_residual():
    codec = get_codec("int2")
    feedback = UplinkFeedback(codec)
    feedback.encode(0, torch.randn(256))
    d = torch.randn(128)
    assert torch.equal(codec.decode(feedback.encode(0, d), 128), codec.decode(codec.encode(d), 128))


def test_a_non_finite_delta_is_refused_and_leaves_the_residual_as_it_was():
    feedback = UplinkFeedback(get_codec("int4"))
    feedback.encode(0, torch.randn(128))
    before = feedback.residual[0].clone()
    with pytest.raises(ValueError, match="non-finite"):
        feedback.encode(0, torch.full((128,), float("nan")))
    assert torch.equal(feedback.residual[0], before)


def test_concurrent_pushes_of_one_fragment_take_the_residual_in_turn():
    codec = get_codec("int2")
    feedback = UplinkFeedback(codec)
    deltas = _deltas(64, 1024, seed=1)
    received = []
    lock = threading.Lock()

    def push(d):
        payload = feedback.encode(5, d)
        with lock:
            received.append(codec.decode(payload, d.numel()))

    threads = [threading.Thread(target=push, args=(d,)) for d in deltas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert torch.allclose(sum(deltas) - sum(received), feedback.residual[5], atol=1e-4)


def test_a_residual_taken_for_the_parameters_is_not_added_to_the_next_push():
    """uplink_residual='parameters': the island takes the residual at its apply; the fragment's
    next push is the codec's encoding of its progress alone, and the other fragments keep theirs."""
    codec = get_codec("sparse", density=1 / 64)
    feedback = UplinkFeedback(codec)
    a, b = _deltas(2, 4096)
    feedback.encode(0, a)
    feedback.encode(1, a)
    left = feedback.residual[0].clone()
    assert torch.equal(feedback.take(0), left) and feedback.take(0) is None
    assert torch.equal(feedback.encode(0, b), codec.encode(b))
    assert not torch.equal(feedback.encode(1, b), codec.encode(b))
