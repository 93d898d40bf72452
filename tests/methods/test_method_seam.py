"""The method seam (docs/design.md §3): a new method is one type, defined here with no edit of ``src/``.

``DiagonalKronecker`` approximates each factor by its diagonal, ``V = (diag G + √λ)⁻¹ ∇ (diag A + √λ)⁻¹``,
with a decomposition of its own (``DiagonalDecomposer``: a vector per factor, saved as a dict no
built-in method uses). It is registered, trained against a dense reference computed here from the
captured rows, checkpointed and resumed bit-exactly, sized by ``memory_usage()``, and run on two
gloo ranks: with ``grad_worker_fraction=1`` its decompositions travel from their owners to the
other rank, with ``0.5`` its directions do; both agree with one process on the whole batch.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kfac_optim import KFAC, CurvatureConfig, RuntimeConfig
from kfac_optim.methods import Basis, Method, register_method
from kfac_optim.methods.decompositions import Decomposer, FactorView
from tests.distributed_helpers import spawn


class DiagonalDecomposer(Decomposer):
    """``(diag F + shift)⁻¹`` as a vector ``(*batch, dim)`` for a factor of any kind."""

    @staticmethod
    def shape(factor: FactorView) -> tuple[int, ...]:
        return (factor.dim,) if factor.diagonal else (*factor.batch_shape, factor.dim)

    def decompose(self, factor: FactorView, shift: float, dtype: torch.dtype,
                  drop_below: float | None = None) -> Tensor:
        diagonal = factor.running if factor.diagonal else factor.running.diagonal(dim1=-2, dim2=-1)
        return (diagonal.clamp(min=0) + shift).reciprocal().to(dtype)

    def tensors(self, factor: FactorView) -> list[Tensor]:
        return [factor.decomposition]

    def buffers(self, factor: FactorView, dtype: torch.dtype, device: torch.device, columns: int) -> list[Tensor]:
        return [torch.empty(self.shape(factor), dtype=dtype, device=device)]

    def from_tensors(self, factor: FactorView, parts: Sequence[Tensor]) -> Tensor:
        return parts[0]

    def symmetric(self, factor: FactorView) -> list[bool]:
        return [False]

    def elements(self, diagonal: bool, dim: int, count: int = 1) -> int:
        return dim if diagonal else count * dim

    def nbytes(self, decomposition: Tensor | None) -> int:
        return 0 if decomposition is None else decomposition.nbytes

    def saved(self, factor: FactorView, decomposition: Tensor) -> dict[str, Tensor]:
        return {"inverse_diagonal": decomposition}

    def loaded(self, factor: FactorView, saved: dict[str, Tensor]) -> Tensor:
        return saved["inverse_diagonal"].to(factor.device, copy=True)

    def check_saved(self, factor: FactorView, saved: Any, field: str) -> None:
        tensor = saved.get("inverse_diagonal") if isinstance(saved, dict) else None
        if (not isinstance(tensor, Tensor) or tuple(tensor.shape) != self.shape(factor)
                or not torch.isfinite(tensor).all()):
            raise ValueError(f"'{field}' must be {{'inverse_diagonal': a finite tensor of shape {self.shape(factor)}}}")


@register_method
class DiagonalKronecker(Method):
    """``V = (diag G + √λ)⁻¹ ∇ (diag A + √λ)⁻¹``: each factor by its damped diagonal."""

    name: ClassVar[str] = "diagonal_seam_test"
    basis: ClassVar[Basis] = Basis.INVERSE  # damped inverses, of the factors' diagonals
    decomposer: ClassVar[Decomposer] = DiagonalDecomposer()

    def shifts(self, a: FactorView, g: FactorView, damping: float) -> tuple[float, float]:
        return damping**0.5, damping**0.5

    def precondition(self, grad: Tensor, a: FactorView, g: FactorView, damping: float,
                     state: dict[str, Tensor]) -> Tensor:
        return grad * g.decomposition.unsqueeze(-1) * a.decomposition.unsqueeze(-2)

    def approximations(self, pairs: Sequence[tuple[str, FactorView, FactorView]]) -> str | None:
        return f"{self.name}: every factor by its diagonal: {', '.join(layer for layer, _, _ in pairs)}"


DAMPING = 0.1
SETTINGS: dict[str, Any] = dict(lr=0.1, momentum=0.9, damping=DAMPING, kl_clip=None, method="diagonal_seam_test",
                                factor_update_steps=1, decomposition_update_steps=2)


def seam_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def seam_batch(step: int, rank: int = 0, world: int = 1) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    shard = slice(rank * 8 // world, (rank + 1) * 8 // world)
    return x[shard], y[shard]


def seam_train(model: nn.Module, optimizer: KFAC, steps: range, rank: int = 0, world: int = 1) -> None:
    for step in steps:
        x, y = seam_batch(step, rank, world)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def seam_parameters(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_one_step_is_the_dense_diagonal_reference() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(6, 3).double()
    optimizer = KFAC(layer, lr=0.5, damping=DAMPING, kl_clip=None, method="diagonal_seam_test",
                     curvature=CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64))
    assert isinstance(optimizer.method, DiagonalKronecker)
    assert "diagonal_seam_test: every factor by its diagonal" in optimizer.describe()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    out = layer(x)
    out.retain_grad()
    F.cross_entropy(out, y).backward()
    rows_a = torch.cat([x, torch.ones(8, 1, dtype=torch.float64)], dim=1)
    rows_g = 8 * out.grad  # ĝ = N·g for a mean-reduced loss
    a = rows_a.T @ rows_a / 8
    g = rows_g.T @ rows_g / 8
    grad = torch.cat([layer.weight.grad, layer.bias.grad.unsqueeze(1)], dim=1)
    expected = torch.diag(1 / (g.diagonal() + DAMPING**0.5)) @ grad @ torch.diag(1 / (a.diagonal() + DAMPING**0.5))
    before = torch.cat([layer.weight, layer.bias.unsqueeze(1)], dim=1).detach().clone()
    optimizer.step()
    after = torch.cat([layer.weight, layer.bias.unsqueeze(1)], dim=1).detach()
    torch.testing.assert_close((before - after) / 0.5, expected, rtol=1e-10, atol=1e-12)


def test_checkpoint_holds_its_own_format_and_resumes_bit_exactly() -> None:
    model = seam_net()
    optimizer = KFAC(model, **SETTINGS)
    seam_train(model, optimizer, range(3))  # decomposed at steps 0 and 2, factors folded since: the saved one is needed
    state = copy.deepcopy(optimizer.state_dict())
    saved_model = copy.deepcopy(model.state_dict())
    seam_train(model, optimizer, range(3, 6))

    for block in optimizer.blocks:
        for name, factor in block.factors.items():
            saved = state["kfac"]["blocks"][block.name]["factors"][name]["decomposition"]
            assert set(saved) == {"inverse_diagonal"} and saved["inverse_diagonal"].shape == (factor.dim,)
    held = sum(f.decomposition.nbytes for block in optimizer.blocks for f in block.factors.values())
    assert optimizer.memory_usage()["decompositions"] == held

    resumed_model = seam_net()
    resumed_model.load_state_dict(saved_model)
    resumed = KFAC(resumed_model, **SETTINGS)
    resumed.load_state_dict(state)
    seam_train(resumed_model, resumed, range(3, 6))
    for a, b in zip(seam_parameters(model), seam_parameters(resumed_model), strict=True):
        assert torch.equal(a, b)

    broken = copy.deepcopy(state)
    broken["kfac"]["blocks"]["0"]["factors"]["A"]["decomposition"] = {"inverse_diagonal": torch.ones(3)}
    with pytest.raises(ValueError, match=r"layer '0', factor A: 'decomposition' must be \{'inverse_diagonal'"):
        KFAC(seam_net(), **SETTINGS).load_state_dict(broken)


def seam_scenario(rank: int, world: int, directory: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for fraction in (1.0, 0.5):
        model = DDP(seam_net())
        optimizer = KFAC(model, **SETTINGS, runtime=RuntimeConfig(grad_worker_fraction=fraction))
        seam_train(model, optimizer, range(4), rank, world)
        results[f"params {fraction}"] = seam_parameters(model.module)
        results[f"owned {fraction}"] = optimizer.owned_factors
        results[f"decompositions {fraction}"] = {
            f"{block.name}.{name}": None if factor.decomposition is None else factor.decomposition.clone()
            for block in optimizer.blocks for name, factor in block.factors.items()
        }
    return results


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_two_ranks_ship_its_decompositions_and_equal_one_process(tmp_path: Path) -> None:
    ranks = spawn(seam_scenario, 2, tmp_path, deadline_s=90.0)
    model = seam_net()
    seam_train(model, KFAC(model, **SETTINGS), range(4))
    reference = seam_parameters(model)
    for fraction in (1.0, 0.5):
        for results in ranks:
            for actual, expected in zip(results[f"params {fraction}"], reference, strict=True):
                torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)
        assert all(torch.equal(a, b)
                   for a, b in zip(ranks[0][f"params {fraction}"], ranks[1][f"params {fraction}"], strict=True))
    # grad_worker_fraction=1: each factor is decomposed by one rank and travels to the other.
    owned = [set(results["owned 1.0"]) for results in ranks]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    for key in owned[0] | owned[1]:
        held = [results["decompositions 1.0"][key] for results in ranks]
        assert held[0] is not None and torch.equal(held[0], held[1]), key


def test_a_method_without_a_decomposer_is_refused_naming_it() -> None:
    class NoLayout(Method):
        name: ClassVar[str] = "no_layout"
        basis: ClassVar[Basis] = Basis.INVERSE

        def shifts(self, a: FactorView, g: FactorView, damping: float) -> tuple[float, float]:
            return 0.0, 0.0

        def precondition(self, grad: Tensor, a: FactorView, g: FactorView, damping: float,
                         state: dict[str, Tensor]) -> Tensor:
            return grad

    with pytest.raises(TypeError, match="method NoLayout has no decomposer"):
        KFAC(nn.Linear(3, 2), method=NoLayout())


def test_a_decomposition_saved_by_another_layout_is_refused_naming_the_field() -> None:
    model = seam_net()
    saved = KFAC(model, **{**SETTINGS, "method": "inverse"})
    seam_train(model, saved, range(1))
    state = saved.state_dict()
    with pytest.raises(ValueError, match=r"layer '0', factor A: 'decomposition' must be a dict with 'Q' and 'd'"):
        KFAC(seam_net(), **{**SETTINGS, "method": "eigen"}).load_state_dict(state)
    KFAC(seam_net(), **{**SETTINGS, "method": "inverse"}).load_state_dict(state)  # its own layout loads
