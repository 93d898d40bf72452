"""Behaviour at the edges that small slips in the code (an off-by-one, ``<`` for ``<=``, a dropped
condition or term) would change, checked through the public API:

- ``describe()``'s share counts exactly the weight matrices (2+ dims) K-FAC preconditions, and
  a model without weight matrices is fully covered (100%, not 0%);
- the ``create_graph=True`` warning: once, and only for a step whose every backward built a graph;
- a decomposition is refreshed when the damping changes although the factors did not (inverse
  method: ``(F + shift·I)⁻¹`` depends on the damping), and when the factors change although the
  damping did not (eigen method: its decomposition does not depend on the damping), checked
  against dense references;
- ``weight_sharing="reduce"``: the warning about one layer called with different batch sizes in
  one backward pass is given once, and never for calls from different backward passes;
- the construction-time note about factors that take seconds to decompose names exactly the
  factors of dim >= 4096 (docs/api.md), not one of dim 4095.
"""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import kron_solve
from torch import nn

from kfac_optim import KFAC, CurvatureConfig, Eigen

# -- describe() ------------------------------------------------------------------------------------


def test_describe_counts_the_weight_matrices_kfac_preconditions_and_no_other_parameter() -> None:
    """Conv weight (2, 1, 3, 3) = 18 and Linear weight (3, 32) = 96 preconditioned; the skipped
    Linear's (2, 3) = 6 is not; biases and the LayerNorm's 1-dim parameters are no matrices."""
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(32, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    optimizer = KFAC(model, lr=0.1, curvature=CurvatureConfig(skip_layers=["4"]), factor_update_steps=1,
                     decomposition_update_steps=10)
    first_line = optimizer.describe().splitlines()[0]
    assert "precondition 114/120 weight-matrix elements (95.0%)" in first_line, first_line


def test_describe_reports_full_coverage_for_a_model_without_weight_matrices() -> None:
    model = nn.Sequential(nn.LayerNorm(4))  # parameters of 1 dim only: nothing to cover, nothing missed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # whether K-FAC takes the LayerNorm or not is not the point here
        optimizer = KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    assert "0/0 weight-matrix elements (100.0%)" in optimizer.describe().splitlines()[0]


# -- create_graph=True backward passes ------------------------------------------------------------


def _mlp_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(3)
    return (nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)),
            torch.randn(12, 6, generator=generator), torch.randint(0, 3, (12,), generator=generator))


def _graph_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "K-FAC records" in str(w.message)]  # not torch's own


def test_factor_steps_whose_every_backward_builds_a_graph_warn_once() -> None:
    model, x, y = _mlp_and_batch()
    optimizer = KFAC(model, lr=0.01, factor_update_steps=1, decomposition_update_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward(create_graph=True)
            optimizer.step()
    assert len(_graph_warnings(record)) == 1


def test_a_gradient_penalty_step_records_its_final_backward_without_warning() -> None:
    """A ``create_graph=True`` backward followed, in the same step, by the plain backward that
    produces ``.grad``: the plain one is recorded, so nothing is reported."""
    model, x, y = _mlp_and_batch()
    optimizer = KFAC(model, lr=0.01, factor_update_steps=1, decomposition_update_steps=1)
    x.requires_grad_(True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            (gx,) = torch.autograd.grad(loss, x, create_graph=True)
            (loss + gx.square().sum()).backward()
            optimizer.step()
    assert _graph_warnings(record) == []


# -- a new damping refreshes a decomposition that depends on it ----------------------------------------


def _inverse_method_direction(A: torch.Tensor, G: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """``(G + s_G·I)⁻¹ ∇ (A + s_A·I)⁻¹`` with the factored shifts ``s_A = π√λ``, ``s_G = √λ/π``,
    ``π² = (tr A / dim A) / (tr G / dim G)`` (Martens & Grosse 2015, §6.3; docs/design.md)."""
    pi = ((torch.trace(A) / len(A)) / (torch.trace(G) / len(G))).sqrt()
    root = damping**0.5
    shifted_A = A + pi * root * torch.eye(len(A), dtype=A.dtype)
    shifted_G = G + root / pi * torch.eye(len(G), dtype=G.dtype)
    return torch.linalg.solve(shifted_G, grad) @ torch.linalg.inv(shifted_A)


def test_a_new_damping_refreshes_the_inverse_although_the_factors_did_not_change() -> None:
    """Step 0 folds the factors and inverts them with damping 0.1; step 1 records nothing (the
    layer is called functionally, so its factors keep their version) and decomposes again with
    damping 10: its update must use ``(F + shift(10)·I)⁻¹``, not the inverse kept from step 0."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 4, generator=generator, dtype=torch.float64), torch.randint(0, 3, (16,), generator=generator)
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, method="inverse", factor_update_steps=1, decomposition_update_steps=1,
                     damping=lambda step: 0.1 if step == 0 else 10.0,
                     curvature=CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64))
    optimizer.zero_grad()
    F.cross_entropy(layer(x), y).backward()
    optimizer.step()
    (block,) = optimizer.blocks
    A, G = block.A.running.clone(), block.G.running.clone()

    optimizer.zero_grad()
    F.cross_entropy(F.linear(x, layer.weight, layer.bias), y).backward()  # no hook fires: no statistics
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
    before = torch.cat([layer.weight.detach(), layer.bias.detach()[:, None]], dim=1).clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # whatever is said about a step without statistics
        optimizer.step()
    after = torch.cat([layer.weight.detach(), layer.bias.detach()[:, None]], dim=1)
    torch.testing.assert_close(block.A.running, A, rtol=0, atol=0)  # the factors did not change
    torch.testing.assert_close(block.G.running, G, rtol=0, atol=0)
    torch.testing.assert_close(before - after, _inverse_method_direction(A, G, grad, 10.0), rtol=1e-8, atol=1e-10)


def test_new_factors_refresh_the_eigendecomposition_at_an_unchanged_damping() -> None:
    """Eigen method, constant damping: every step folds new factors and decomposes; each step's
    update is ``(G ⊗ A + λI)⁻¹ vec ∇`` of that step's factors, not of the first step's."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    optimizer = KFAC(layer, lr=1.0, kl_clip=None, method="eigen", damping=0.1, factor_update_steps=1,
                     decomposition_update_steps=1,
                     curvature=CurvatureConfig(factor_decay=0.5, factor_dtype=torch.float64, inv_dtype=torch.float64))
    (block,) = optimizer.blocks
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(16, 4, generator=generator, dtype=torch.float64) * (1 + seed)  # factors change a lot
        y = torch.randint(0, 3, (16,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(layer(x), y).backward()
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
        before = torch.cat([layer.weight.detach(), layer.bias.detach()[:, None]], dim=1).clone()
        optimizer.step()
        after = torch.cat([layer.weight.detach(), layer.bias.detach()[:, None]], dim=1)
        expected = kron_solve(block.G.running, block.A.running, grad, 0.1)
        torch.testing.assert_close(before - after, expected, rtol=1e-6, atol=1e-9, msg=f"step {seed}")


# -- weight_sharing="reduce": calls with different batch sizes ------------------------------------


def _mismatch_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "treats those calls as different samples" in str(w.message)]


def test_reduce_warns_once_about_one_backward_over_calls_with_different_batch_sizes() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    optimizer = KFAC(layer, lr=0.01, curvature=CurvatureConfig(weight_sharing="reduce"),
                     factor_update_steps=1, decomposition_update_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            optimizer.zero_grad()
            (layer(torch.randn(4, 2, 3)).square().mean() + layer(torch.randn(2, 2, 3)).square().mean()).backward()
            optimizer.step()
    assert len(_mismatch_warnings(record)) == 1


def test_reduce_does_not_warn_about_micro_batches_of_different_sizes() -> None:
    """Gradient accumulation: each micro-batch has its own backward pass, so different sizes are
    expected; the per-sample sums of one backward are complete before the next one starts."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    optimizer = KFAC(layer, lr=0.01, curvature=CurvatureConfig(weight_sharing="reduce"),
                     factor_update_steps=1, decomposition_update_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            optimizer.zero_grad()
            for size in (4, 2):
                layer(torch.randn(size, 2, 3)).square().mean().backward()
            optimizer.step()
    assert _mismatch_warnings(record) == []


# -- the note about factors that take seconds to decompose ---------------------------------------


def test_the_large_factor_note_starts_at_dim_4096_exactly(caplog: pytest.LogCaptureFixture) -> None:
    """docs/api.md: factors of dim >= 4096 decomposed at full rank are named; here A of the first
    Linear is 4095 + 1 (bias) = 4096 and G of the second is 4096, while G of the first, A of the
    second (no bias) and A of the third (4094 + 1) are 4095, one short of it. Full eigenbases (no
    cap): under the default cap none is named (tests/project/test_public_surface.py)."""
    with torch.device("meta"):  # only the sizes matter: nothing is allocated
        model = nn.Sequential(nn.Linear(4095, 4095), nn.Linear(4095, 4096, bias=False), nn.Linear(4094, 2))
    with caplog.at_level(logging.WARNING):
        KFAC(model, lr=0.1, method=Eigen(max_rank=None), factor_update_steps=1, decomposition_update_steps=10)
    (record,) = [r for r in caplog.records if "seconds" in r.getMessage()]
    named = set(re.findall(r"\b\d+\.[AG] \(\d+\)", record.getMessage()))
    assert named == {"0.A (4096)", "1.G (4096)"}, record.getMessage()
