import torch

from lightning_diloco.core.config import OuterConfig
from lightning_diloco.core.outer import OuterOptimizer


def test_outer_steps_equal_the_textbook_nesterov_formula():
    """buf = mu * buf + g;  theta -= lr * (g + mu * buf), with buf starting at g."""
    lr, mu = 0.7, 0.9
    theta = torch.randn(50)
    opt = OuterOptimizer(theta, OuterConfig(lr=lr, momentum=mu))
    expected, buf = theta.clone(), None
    for _ in range(4):
        g = torch.randn(50)
        buf = g.clone() if buf is None else mu * buf + g
        expected = expected - lr * (g + mu * buf)
        opt.step(g)
    assert torch.allclose(theta, expected, atol=1e-6)


def test_lr_one_momentum_zero_is_plain_averaging():
    theta = torch.tensor([1.0, 2.0])
    OuterOptimizer(theta, OuterConfig(lr=1.0, momentum=0.0)).step(torch.tensor([0.5, -1.0]))
    assert torch.equal(theta, torch.tensor([0.5, 3.0]))


def test_momentum_buffer_can_be_saved_and_restored():
    theta = torch.randn(8)
    opt = OuterOptimizer(theta, OuterConfig())
    opt.step(torch.randn(8))
    saved = opt.momentum_buffer.clone()
    other = OuterOptimizer(theta.clone(), OuterConfig())
    other.momentum_buffer = saved
    g = torch.randn(8)
    opt.step(g)
    other.step(g)
    assert torch.equal(opt.fragment, other.fragment)


def test_delayed_nesterov_with_every_island_in_each_round_is_the_nesterov_step():
    theta = torch.randn(20)
    plain, delayed = theta.clone(), theta.clone()
    a = OuterOptimizer(plain, OuterConfig(lr=0.7, momentum=0.9))
    b = OuterOptimizer(delayed, OuterConfig(lr=0.7, momentum=0.9, delayed_nesterov=True))
    for _ in range(5):
        g = torch.randn(20)
        a.step(g)
        b.step(g, share=1.0)
    assert torch.allclose(plain, delayed, atol=1e-5)


def test_delayed_nesterov_moves_partial_rounds_by_their_share_and_the_momentum_once_per_n():
    """Four rounds of one island of four: each applies lr * g / 4 at once; the fourth also updates
    the momentum from the four's mean and applies lr * mu * buf."""
    lr, mu = 0.5, 0.8
    theta = torch.zeros(6)
    opt = OuterOptimizer(theta, OuterConfig(lr=lr, momentum=mu, delayed_nesterov=True))
    grads = [torch.randn(6) for _ in range(4)]
    expected = torch.zeros(6)
    for i, g in enumerate(grads):
        opt.step(g, share=0.25)
        expected -= lr * g / 4
        if i < 3:
            assert opt.momentum_buffer is None and torch.allclose(theta, expected, atol=1e-6)
    buf = sum(grads) / 4
    expected -= lr * mu * buf
    assert torch.allclose(theta, expected, atol=1e-6) and torch.allclose(opt.momentum_buffer, buf, atol=1e-6)


def test_delayed_nesterov_state_round_trips_mid_gathering():
    config = OuterConfig(lr=0.7, momentum=0.9, delayed_nesterov=True)
    theta = torch.randn(8)
    opt = OuterOptimizer(theta, config)
    for share in (1.0, 0.5):
        opt.step(torch.randn(8), share=share)
    other = OuterOptimizer(theta.clone(), config)
    other.load_state_dict(opt.state_dict())
    g = torch.randn(8)
    opt.step(g, share=0.5)
    other.step(g, share=0.5)
    assert torch.equal(opt.fragment, other.fragment) and torch.equal(opt.momentum_buffer, other.momentum_buffer)
