"""``RootKronecker`` (method="root"): ``V = (G + λI)^(-1/p) ∇ (A + λI)^(-1/p)`` (docs/api.md, Methods),
and the seam it proves: a method declares the basis it takes (``methods.Basis``) and is never
handed another one.

References from first principles in float64: ``A = (1/N) Σ [x 1][x 1]ᵀ``, ``G = (1/N) Σ ĝ ĝᵀ`` with
``ĝ = out − target`` (the gradient of each sample's loss ``½‖out − target‖²`` w.r.t. the output),
and the matrix roots through ``torch.linalg.eigh`` of the damped factors.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim import KFAC, CurvatureConfig, Eigen, RootKronecker
from kfac_optim.methods import METHODS, Basis

FLOAT64 = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64)


@pytest.fixture(autouse=True)
def _default_float64() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def damped_root(factor: Tensor, damping: float, exponent: float) -> Tensor:
    """``(F + λI)^(-1/p)`` from ``eigh`` of the damped symmetric ``F``."""
    d, u = torch.linalg.eigh(factor + damping * torch.eye(len(factor)))
    return u @ torch.diag(d.pow(-1.0 / exponent)) @ u.T


def first_step(layer: nn.Linear, x: Tensor, target: Tensor, method: Any, damping: float) -> tuple[KFAC, Tensor, Tensor]:
    """One step at lr=1, no KL clip, the factors the batch's: the optimizer, ``∇`` and the applied direction."""
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, damping=damping, method=method, factor_update_steps=1,
                     decomposition_update_steps=10, curvature=FLOAT64)
    before = torch.cat([layer.weight.detach(), layer.bias.detach()[:, None]], 1)
    (0.5 * ((layer(x) - target) ** 2).sum(1).mean()).backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1)
    optimizer.step()
    return optimizer, grad, before - torch.cat([layer.weight.detach(), layer.bias.detach()[:, None]], 1)


@pytest.mark.parametrize("exponent", [4.0, 2.0, 1.0])
@pytest.mark.parametrize("width, batch", [(5, 16), (64, 2)])  # (64, 2): A 65x65 of rank 3, never held thin
def test_direction_equals_the_dense_damped_roots_of_the_factors(exponent: float, width: int, batch: int) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(width, 3)
    x, target = torch.randn(batch, width), torch.randn(batch, 3)
    rows = torch.cat([x, torch.ones(batch, 1)], 1)
    a_ref = rows.T @ rows / batch
    g_hat = (layer(x) - target).detach()
    g_ref = g_hat.T @ g_hat / batch
    damping = 0.05
    optimizer, grad, direction = first_step(layer, x, target, RootKronecker(exponent=exponent), damping)
    block = optimizer.blocks[0]
    torch.testing.assert_close(block.A.running, a_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.G.running, g_ref, rtol=1e-12, atol=1e-12)
    assert block.A.decomposition.Q.shape == (width + 1, width + 1) and block.A.decomposition.complement is None
    expected = damped_root(g_ref, damping, exponent) @ grad @ damped_root(a_ref, damping, exponent)
    torch.testing.assert_close(direction, expected, rtol=1e-9, atol=1e-12)


def test_an_embeddings_diagonal_factor_is_rooted_elementwise() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(6, 4), nn.Flatten(), nn.Linear(8, 3))
    tokens, labels = torch.randint(0, 6, (12, 2)), torch.randint(0, 3, (12,))
    optimizer = KFAC(model, lr=1.0, kl_clip=None, damping=0.1, method="root", factor_update_steps=1,
                     decomposition_update_steps=10, curvature=FLOAT64)
    F.cross_entropy(model(tokens), labels).backward()
    embed = optimizer.blocks[0]
    assert embed.A.diagonal
    grad = embed.grad_matrix().clone()
    before = [p.detach().clone() for p in embed.parameters()]
    optimizer.step()
    deltas = [b - p.detach() for b, p in zip(before, embed.parameters(), strict=True)]
    applied = embed.joint_gradient(deltas[0], deltas[1] if len(deltas) > 1 else None)
    a_root = torch.diag((embed.A.running.clamp(min=0) + 0.1).pow(-0.25))
    expected = damped_root(embed.G.running, 0.1, 4.0) @ grad @ a_root
    torch.testing.assert_close(applied, expected, rtol=1e-9, atol=1e-12)


def test_a_method_declares_its_basis_and_never_gets_another() -> None:
    with pytest.raises(TypeError, match="Undeclared defines precondition but does not declare the basis"):
        class Undeclared(Eigen):  # an Eigen subclass with its own solve, which would inherit the capped basis
            def precondition(self, grad: Tensor, a: Any, g: Any, damping: float, state: dict[str, Tensor]) -> Tensor:
                return grad
    with pytest.raises(ValueError, match=r"RootKronecker takes full eigenbases .* max_rank=8"):
        RootKronecker(max_rank=8)

    class Full(Eigen):
        basis: ClassVar[Basis] = Basis.FULL

    # A 65x65 of rank 2 (two rows): Eigen holds it thin (65, 2), a method declaring FULL whole.
    for method, columns in ((Eigen(max_rank=None), 2), (Full(max_rank=None), 65)):
        layer = nn.Linear(64, 3)
        optimizer = KFAC(layer, lr=0.1, method=method, factor_update_steps=1, decomposition_update_steps=10)
        layer(torch.randn(2, 64)).sum().backward()
        optimizer.step()
        assert optimizer.blocks[0].A.decomposition.Q.shape == (65, columns), method
    with pytest.raises(ValueError, match=r"Full takes full eigenbases .* max_rank=128"):
        Full()  # Eigen's default cap
    for method in METHODS.values():
        assert isinstance(method.basis, Basis), method


@pytest.mark.parametrize("exponent", [0.0, -2.0, float("inf"), float("nan"), True])
def test_bad_exponent_names_it(exponent: Any) -> None:
    with pytest.raises(ValueError, match="exponent"):
        RootKronecker(exponent=exponent)


def test_named_by_string_and_describe_names_it() -> None:
    optimizer = KFAC(nn.Linear(4, 2), lr=0.1, method="root")
    assert isinstance(optimizer.method, RootKronecker) and METHODS["root"] is RootKronecker
    assert optimizer.describe().startswith("KFAC (root)")
    assert repr(RootKronecker(exponent=2)) == "RootKronecker(exponent=2)"


def root_step(model: nn.Module, optimizer: KFAC, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def test_checkpoint_resume_continues_bit_identically() -> None:
    def make() -> tuple[nn.Module, KFAC]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        return model, KFAC(model, lr=0.05, method=RootKronecker(exponent=2), factor_update_steps=1,
                           decomposition_update_steps=3)

    model, optimizer = make()
    for step in range(4):  # step 3 decomposed: the resumed run holds the same bases
        root_step(model, optimizer, step)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    for step in range(4, 8):
        root_step(model, optimizer, step)
    resumed, resumed_optimizer = make()
    resumed.load_state_dict(saved_model)
    resumed_optimizer.load_state_dict(saved_optimizer)
    for step in range(4, 8):
        root_step(resumed, resumed_optimizer, step)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
