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
