"""Hugging Face's ``Conv1D`` (GPT-2's layers: a Linear with its weight stored ``(in, out)``) gets K-FAC.

References: per-sample output gradients from autograd on per-sample losses, explicit Kronecker
products and ``torch.linalg.solve``; and the twin ``nn.Linear`` holding the transposed weight.
The block is registered by the class's dotted name, so ``import kfac_optim`` never imports
transformers (checked in a fresh interpreter).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import kron_solve
from torch import nn

from kfac_optim import KFAC, CurvatureConfig
from kfac_optim.layers import TransposedLinearBlock, block_kind

FLOAT64 = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64)


class TransposedLinearStandIn(nn.Module):
    """``transformers.pytorch_utils.Conv1D`` as transformers writes it (``nf`` outputs, ``nx`` inputs),
    named as it is, for machines without transformers."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.nf)


TransposedLinearStandIn.__module__ = "transformers.pytorch_utils"
TransposedLinearStandIn.__qualname__ = "Conv1D"


def conv1d_class() -> type[nn.Module]:
    """transformers' ``Conv1D`` where it is installed, else the stand-in of the same name."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return TransposedLinearStandIn
    return Conv1D


@pytest.fixture(autouse=True)
def _conv1d_float64() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def conv1d_layer(nf: int, nx: int) -> nn.Module:
    torch.manual_seed(0)
    layer = conv1d_class()(nf, nx)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over the N samples of each sample's ``½‖out − target‖²``."""
    return 0.5 * ((out - target) ** 2).flatten(1).sum(1).mean()


def test_conv1d_gets_the_transposed_linear_block() -> None:
    layer = conv1d_layer(3, 5)
    assert block_kind(layer) is TransposedLinearBlock
    assert block_kind(TransposedLinearStandIn(3, 5)) is TransposedLinearBlock


def test_conv1d_factors_and_step_match_the_dense_reference() -> None:
    layer = conv1d_layer(3, 5)  # W: (5, 3), y = x W + b
    x, target = torch.randn(4, 6, 5), torch.randn(4, 6, 3)
    out = layer(x)
    g_hat = []  # each sample's own loss's gradient w.r.t. the output: ĝ rows (N·R, 3)
    for n in range(4):
        (grad,) = torch.autograd.grad(0.5 * ((out[n] - target[n]) ** 2).sum(), out, retain_graph=True)
        g_hat.append(grad[n].reshape(-1, 3))
    g_rows = torch.cat(g_hat)
    a_rows = torch.cat([x.reshape(-1, 5), torch.ones(24, 1)], 1)
    A_ref, G_ref = a_rows.T @ a_rows / 24, g_rows.T @ g_rows / 4

    damping = 0.1
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, damping=damping, factor_update_steps=1, decomposition_update_steps=10,
                     curvature=FLOAT64)
    before = torch.cat([layer.weight.detach().T, layer.bias.detach()[:, None]], 1)  # [W_linear | b]: (3, 6)
    squared_error(layer(x), target).backward()
    grad = torch.cat([layer.weight.grad.T, layer.bias.grad[:, None]], 1)
    optimizer.step()
    after = torch.cat([layer.weight.detach().T, layer.bias.detach()[:, None]], 1)
    (block,) = optimizer.blocks
    torch.testing.assert_close(block.A.running, A_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.G.running, G_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(before - after, kron_solve(G_ref, A_ref, grad, damping), rtol=1e-9, atol=1e-12)


def test_conv1d_trains_as_the_linear_holding_its_transposed_weight() -> None:
    conv = conv1d_layer(3, 5)
    linear = nn.Linear(5, 3)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.T)
        linear.bias.copy_(conv.bias)
    start = linear.weight.detach().clone()
    x, target = torch.randn(8, 4, 5), torch.randn(8, 4, 3)
    settings = dict(lr=0.3, momentum=0.9, factor_update_steps=1, decomposition_update_steps=2, curvature=FLOAT64)
    optimizers = [KFAC(conv, **settings), KFAC(linear, **settings)]
    for _ in range(4):
        for layer, optimizer in zip((conv, linear), optimizers, strict=True):
            optimizer.zero_grad()
            squared_error(layer(x), target).backward()
            optimizer.step()
    conv_block, linear_block = (optimizer.blocks[0] for optimizer in optimizers)
    for name in ("A", "G"):
        torch.testing.assert_close(conv_block.factors[name].running, linear_block.factors[name].running,
                                   rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(conv.weight.T, linear.weight, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(conv.bias, linear.bias, rtol=1e-10, atol=1e-12)
    assert (linear.weight - start).abs().max() > 1e-2  # the twins moved alike, not stayed alike


def test_importing_kfac_optim_does_not_import_transformers(fresh_kfac_interpreter: dict[str, object]) -> None:
    assert fresh_kfac_interpreter["transformers imported"] is False
