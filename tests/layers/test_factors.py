"""Factors and preconditioned gradients against dense references built from first principles.

References: per-sample output gradients from autograd on per-sample losses (ĝ), explicit patch
extraction by slicing (conv), explicit Kronecker products and ``torch.linalg.solve``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from helpers import kron_solve
from torch import nn

from kfac_optim import KFAC, CurvatureConfig, UpdateConfig

DTYPES = {"curvature": CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64)}


@pytest.fixture(autouse=True)
def _float64() -> Iterator[None]:
    """References in float64 make the comparisons tight."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def per_sample_output_grads(layer: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """ĝ: the gradient of each sample's own loss w.r.t. the layer output, stacked over samples."""
    out = layer(x)
    rows = []
    for n in range(x.shape[0]):
        sample_loss = 0.5 * ((out[n] - target[n]) ** 2).sum()
        (grad,) = torch.autograd.grad(sample_loss, out, retain_graph=True)
        rows.append(grad[n])
    return torch.stack(rows)


def mean_loss(layer: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((layer(x) - target) ** 2).flatten(1).sum(1).mean()


def conv_patches_by_slicing(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Rows (N·H_out·W_out, C·kh·kw) taken from the zero-padded input position by position."""
    (kh, kw), (sh, sw), (dh, dw), (ph, pw) = conv.kernel_size, conv.stride, conv.dilation, conv.padding
    padded = F.pad(x, (pw, pw, ph, ph))
    out_h = (padded.shape[2] - dh * (kh - 1) - 1) // sh + 1
    out_w = (padded.shape[3] - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for n in range(x.shape[0]):
        for i in range(out_h):
            for j in range(out_w):
                window = padded[n, :, i * sh : i * sh + dh * (kh - 1) + 1 : dh,
                                j * sw : j * sw + dw * (kw - 1) + 1 : dw]
                rows.append(window.reshape(-1))
    return torch.stack(rows)


def with_bias_column(rows: torch.Tensor, bias: bool) -> torch.Tensor:
    return torch.cat([rows, torch.ones(len(rows), 1)], 1) if bias else rows


def reference_factors(a_rows: torch.Tensor, g_hat_rows: torch.Tensor,
                      n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/numerics.md: A = (1/(N·R)) Σ a aᵀ, G = (1/N) Σ ĝ ĝᵀ over all N·R rows."""
    return a_rows.T @ a_rows / len(a_rows), g_hat_rows.T @ g_hat_rows / n_samples


def joint_grad(layer: nn.Module) -> torch.Tensor:
    grad = layer.weight.grad.reshape(layer.weight.shape[0], -1)
    return torch.cat([grad, layer.bias.grad[:, None]], 1) if layer.bias is not None else grad


def joint_weight(layer: nn.Module) -> torch.Tensor:
    weight = layer.weight.detach().reshape(layer.weight.shape[0], -1)
    return torch.cat([weight, layer.bias.detach()[:, None]], 1) if layer.bias is not None else weight.clone()


def one_kfac_step(layer: nn.Module, x: torch.Tensor, target: torch.Tensor,
                  **kwargs) -> tuple[KFAC, torch.Tensor, torch.Tensor]:
    """Take one step with lr=1 and no momentum: returns the optimizer, ∇W and the applied direction."""
    optimizer = KFAC(layer, lr=1.0, kl_clip=None,
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **DTYPES, **kwargs})
    before = joint_weight(layer)
    mean_loss(layer, x, target).backward()
    grad = joint_grad(layer).clone()
    optimizer.step()
    return optimizer, grad, before - joint_weight(layer)




def assert_one_step_matches_reference(
    layer: nn.Module, x: torch.Tensor, target: torch.Tensor, A_ref: torch.Tensor, G_ref: torch.Tensor, damping: float
) -> None:
    """One K-FAC step builds exactly A_ref and G_ref and moves by (G_ref ⊗ A_ref + λI)⁻¹ ∇W."""
    layer.zero_grad()
    optimizer, grad, direction = one_kfac_step(layer, x, target, damping=damping)
    block = optimizer.blocks[0]
    torch.testing.assert_close(block.A.running, A_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.G.running, G_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(direction, kron_solve(G_ref, A_ref, grad, damping), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_with_leading_dims_matches_dense_reference(bias: bool) -> None:
    layer = nn.Linear(5, 3, bias=bias)
    x, target = torch.randn(4, 6, 5), torch.randn(4, 6, 3)
    g_hat = per_sample_output_grads(layer, x, target).reshape(-1, 3)
    A_ref, G_ref = reference_factors(with_bias_column(x.reshape(-1, 5), bias), g_hat, n_samples=4)
    assert_one_step_matches_reference(layer, x, target, A_ref, G_ref, damping=0.1)


@pytest.mark.parametrize(
    "conv_args",
    [
        {"kernel_size": 3, "padding": 1, "bias": True},
        {"kernel_size": 3, "stride": 2, "padding": 1, "bias": False},
        {"kernel_size": (2, 3), "stride": (1, 2), "padding": (2, 1), "dilation": (2, 1), "bias": True},
    ],
)
def test_conv2d_matches_dense_reference(conv_args: dict) -> None:
    layer = nn.Conv2d(2, 3, **conv_args)
    x = torch.randn(3, 2, 7, 6)
    target = torch.randn_like(layer(x))
    g_hat = per_sample_output_grads(layer, x, target).permute(0, 2, 3, 1).reshape(-1, 3)
    A_ref, G_ref = reference_factors(with_bias_column(conv_patches_by_slicing(layer, x), conv_args["bias"]), g_hat, 3)
    assert_one_step_matches_reference(layer, x, target, A_ref, G_ref, damping=0.05)


@pytest.mark.parametrize(
    "conv_args",
    [
        {"kernel_size": 3, "padding": "same", "dilation": 1},
        {"kernel_size": (2, 4), "padding": "same", "dilation": (2, 1)},
        {"kernel_size": 3, "padding": "same", "dilation": 2},
        {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"},
        {"kernel_size": 3, "padding": 2, "padding_mode": "circular"},
    ],
)
@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
def test_conv2d_patches_reproduce_the_layer_output(conv_args: dict) -> None:
    """Whatever the padding, the captured rows times the joint weight give the layer's output."""
    layer = nn.Conv2d(2, 3, **conv_args)
    x = torch.randn(2, 2, 6, 5)
    optimizer = KFAC(layer, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    rows = optimizer.blocks[0].input_rows(x)
    expected = layer(x).permute(0, 2, 3, 1).reshape(-1, 3)
    torch.testing.assert_close(with_bias_column(rows, True) @ joint_weight(layer).T, expected)


def test_inverse_method_is_pi_damped_kronecker_inverse() -> None:
    layer = nn.Linear(4, 3)
    x, target = torch.randn(16, 4), torch.randn(16, 3)
    damping = 0.2
    optimizer, grad, direction = one_kfac_step(layer, x, target, damping=damping, method="inverse")
    A, G = optimizer.blocks[0].A.running, optimizer.blocks[0].G.running
    pi = ((torch.trace(A) / 5) / (torch.trace(G) / 3)).sqrt()  # A: (4 + 1 bias, 4 + 1)
    expected = (
        torch.linalg.inv(G + damping**0.5 / pi * torch.eye(3))
        @ grad
        @ torch.linalg.inv(A + pi * damping**0.5 * torch.eye(5))
    )
    torch.testing.assert_close(direction, expected, rtol=1e-9, atol=1e-12)


def test_running_average_first_update_then_decay() -> None:
    layer = nn.Linear(3, 2)
    optimizer = KFAC(layer, lr=0.0, decomposition_update_steps=100, factor_update_steps=1,
                     curvature=CurvatureConfig(factor_decay=0.75, factor_dtype=torch.float64, inv_dtype=torch.float64))
    batches = [(torch.randn(8, 3), torch.randn(8, 2)) for _ in range(3)]
    expected = None
    for x, target in batches:
        x_rows = with_bias_column(x, True)
        batch_A = x_rows.T @ x_rows / 8
        expected = batch_A if expected is None else 0.75 * expected + 0.25 * batch_A
        optimizer.zero_grad()
        mean_loss(layer, x, target).backward()
        optimizer.step()
        torch.testing.assert_close(optimizer.blocks[0].A.running, expected, rtol=1e-12, atol=1e-12)


def test_sum_reduction_gives_the_same_factors_as_mean() -> None:
    x, target = torch.randn(8, 3), torch.randn(8, 2)
    factors = {}
    for reduction in ("mean", "sum"):
        torch.manual_seed(1)
        layer = nn.Linear(3, 2)
        optimizer = KFAC(layer, lr=0.0, factor_update_steps=1, decomposition_update_steps=10,
                         curvature=CurvatureConfig(loss_reduction=reduction, factor_dtype=torch.float64,
                                                   inv_dtype=torch.float64))
        loss = mean_loss(layer, x, target) * (8 if reduction == "sum" else 1)
        loss.backward()
        optimizer.step()
        factors[reduction] = optimizer.blocks[0].G.running
    torch.testing.assert_close(factors["sum"], factors["mean"], rtol=1e-12, atol=1e-14)


def test_kl_clip_scales_the_direction_by_nu() -> None:
    layer = nn.Linear(4, 3)
    x, target = torch.randn(16, 4), torch.randn(16, 3)
    lr, kl_clip, damping = 0.5, 1e-4, 0.1
    reference_layer = nn.Linear(4, 3)
    reference_layer.load_state_dict(layer.state_dict())
    _, grad, unclipped = one_kfac_step(reference_layer, x, target, damping=damping)

    optimizer = KFAC(layer, lr=lr, kl_clip=kl_clip, damping=damping, update=UpdateConfig(trust_region="base_lr"),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **DTYPES})
    before = joint_weight(layer)
    mean_loss(layer, x, target).backward()
    optimizer.step()
    applied = (before - joint_weight(layer)) / lr

    nu = min(1.0, (kl_clip / abs(lr**2 * float((unclipped * grad).sum()))) ** 0.5)
    assert nu < 1
    torch.testing.assert_close(applied, nu * unclipped, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("rows, dim", [(300, 130), (260, 517), (40, 130), (300, 20)])
def test_gram_accumulates_rows_product_into_a_view(rows: int, dim: int) -> None:
    """``linalg.add_gram_`` (blocked upper triangle + mirror for large sizes) adds ``rowsᵀ rows``."""
    from kfac_optim import linalg

    first, second = torch.randn(rows, dim), torch.randn(rows, dim)
    buffer = torch.zeros(dim + 1, dim + 1)  # the bias layout: the Gram goes into a strided view
    linalg.add_gram_(buffer[:dim, :dim], first)
    linalg.add_gram_(buffer[:dim, :dim], second)
    torch.testing.assert_close(buffer[:dim, :dim], first.T @ first + second.T @ second, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(buffer, buffer.T, rtol=1e-12, atol=1e-12)
    assert not buffer[dim].any()


@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_with_many_positions_matches_dense_reference(bias: bool) -> None:
    """≥ 64 output positions per sample: A comes from the batched Gram of the unfolded patches."""
    layer = nn.Conv2d(2, 3, kernel_size=3, padding=1, bias=bias)
    x = torch.randn(2, 2, 9, 8)
    target = torch.randn_like(layer(x))
    g_hat = per_sample_output_grads(layer, x, target).permute(0, 2, 3, 1).reshape(-1, 3)
    A_ref, G_ref = reference_factors(with_bias_column(conv_patches_by_slicing(layer, x), bias), g_hat, 2)
    assert_one_step_matches_reference(layer, x, target, A_ref, G_ref, damping=0.05)


@pytest.mark.parametrize("batch, dim, length", [(4, 130, 70), (2, 20, 64)])
def test_column_gram_equals_the_gram_of_the_rows(batch: int, dim: int, length: int) -> None:
    from kfac_optim import linalg

    columns = torch.randn(batch, dim, length)
    rows = columns.transpose(1, 2).reshape(-1, dim)
    buffer = torch.zeros(dim + 1, dim + 1)
    linalg.add_column_gram_(buffer[:dim, :dim], columns)
    torch.testing.assert_close(buffer[:dim, :dim], rows.T @ rows, rtol=1e-12, atol=1e-12)
    assert not buffer[dim].any()
