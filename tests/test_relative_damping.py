"""``damping=RelativeDamping(value)``: each block's λ is ``value`` × the mean eigenvalue of its
``G ⊗ A`` (docs/design.md §4.2), against a dense reference built here from the batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import kron_solve
from kfac_optim import KFAC, CurvatureConfig, RelativeDamping

DOUBLE = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64, factor_decay=0.0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(24, 4, generator=generator, dtype=torch.float64),
            torch.randn(24, 3, generator=generator, dtype=torch.float64))


def _direction(scale: float, damping: float | RelativeDamping, method: str = "eigen") -> tuple[torch.Tensor, ...]:
    """One step at lr 1 without clip on ``scale`` × the MSE: ``(direction, ∇W, A, G)`` of the layer."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, damping=damping, method=method, curvature=DOUBLE,
                     factor_update_steps=1, inv_update_steps=1)
    before = torch.cat([layer.weight, layer.bias[:, None]], 1).detach().clone()
    x, y = _batch()
    (scale * ((layer(x) - y) ** 2).sum(1).mean()).backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).clone()
    optimizer.step()
    block = optimizer.blocks[0]
    after = torch.cat([layer.weight, layer.bias[:, None]], 1).detach()
    return before - after, grad, block.A.running.clone(), block.G.running.clone()


def test_the_step_solves_with_value_times_the_mean_eigenvalue_of_g_kron_a() -> None:
    direction, grad, A, G = _direction(1.0, RelativeDamping(0.05))
    damping = 0.05 * float(torch.trace(A) / len(A)) * float(torch.trace(G) / len(G))
    torch.testing.assert_close(direction, kron_solve(G, A, grad, damping), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_the_direction_does_not_depend_on_the_loss_scale(method: str) -> None:
    """A loss ``c·h`` has ``c·∇`` and (empirical Fisher) ``c²·G``: with λ relative to the factors the
    direction is ``1/c`` times the one of ``h``; a constant λ changes its shape."""
    reference, *_ = _direction(1.0, RelativeDamping(0.1), method)
    scaled, *_ = _direction(1e-3, RelativeDamping(0.1), method)
    torch.testing.assert_close(scaled * 1e-3, reference, rtol=1e-7, atol=1e-12)
    constant, *_ = _direction(1.0, 0.1, method)
    constant_scaled, *_ = _direction(1e-3, 0.1, method)
    assert not torch.allclose(constant_scaled * 1e-3, constant, rtol=1e-2)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), True])
def test_relative_damping_rejects_a_bad_value(value: float) -> None:
    with pytest.raises((ValueError, TypeError), match="RelativeDamping.value"):
        RelativeDamping(value)
