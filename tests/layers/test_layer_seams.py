"""The layers package's seams: per-call block overrides, declared weight-sharing support, and what a
method decides for a factor kind (docs/api.md, "Block registry")."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from kfac_optim import DampedInverse, Eigen, KroneckerBlock, linalg
from kfac_optim.layers import DiagonalFactor, Factor, LinearBlock, block_kind, discover, registered_blocks


class Twice(nn.Module):
    """``y = x Wᵀ`` applied to every position of ``x: (N, R, features)``: a weight shared over R."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features, features))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.T


class TwiceAgain(Twice):
    pass


class RowsOnly(KroneckerBlock):
    """A user's block that takes every position as a row and does not implement "reduce"."""

    def input_rows(self, inputs: Tensor) -> Tensor:
        return inputs.reshape(-1, inputs.shape[-1])

    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        return grad_output.reshape(-1, grad_output.shape[-1])

    def sample_count(self, inputs: Tensor) -> int:
        return inputs.shape[0]


def test_block_overrides_come_before_the_registry_follow_the_mro_and_leave_it_alone() -> None:
    before = registered_blocks()
    model = nn.Sequential(Twice(3), TwiceAgain(3), nn.Linear(3, 3))
    assert [type(b) for b in discover(model)[0]] == [LinearBlock]  # Twice is not registered
    blocks, reports = discover(model, blocks={Twice: LinearBlock, nn.Linear: RowsOnly})
    assert [type(b) for b in blocks] == [LinearBlock, LinearBlock, RowsOnly]
    assert [r.status for r in reports] == ["kfac"] * 3
    assert block_kind(TwiceAgain(2), {Twice: RowsOnly}) is RowsOnly and block_kind(TwiceAgain(2)) is None
    assert registered_blocks() == before


def test_block_overrides_reject_entries_that_are_not_module_and_block_classes() -> None:
    with pytest.raises(TypeError, match="blocks: a key"):
        discover(nn.Linear(2, 2), blocks={int: LinearBlock})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"blocks\[Twice\]"):
        discover(nn.Linear(2, 2), blocks={Twice: object})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="blocks must be a mapping"):
        discover(nn.Linear(2, 2), blocks=[(Twice, LinearBlock)])  # type: ignore[arg-type]


def test_a_block_that_does_not_implement_reduce_keeps_expand_and_says_so() -> None:
    model = nn.Sequential(Twice(3), nn.Linear(3, 3))
    message = r"CurvatureConfig\(weight_sharing='reduce'\) is not implemented by the block\(s\) of '0' \(RowsOnly\)"
    with pytest.warns(UserWarning, match=message):
        (custom, linear), reports = discover(model, blocks={Twice: RowsOnly}, weight_sharing="reduce")
    assert not custom.reduce and linear.reduce
    assert "weight_sharing='reduce' not implemented by RowsOnly" in reports[0].detail
    assert "not implemented" not in reports[1].detail


def test_a_block_without_reduce_folds_the_same_factors_under_reduce() -> None:
    """Asking "reduce" of a block that does not implement it changes nothing in its statistics."""
    x = torch.randn(4, 5, 3)
    factors = []
    for mode in ("expand", "reduce"):
        torch.manual_seed(1)
        model = Twice(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the warning is the test above's
            (block,), _ = discover(nn.Sequential(model), blocks={Twice: RowsOnly}, weight_sharing=mode)
        output = model(x)
        block.accumulate(x, torch.autograd.grad(output.square().sum(), output)[0])
        block.fold(0.0, "mean")
        factors.append((block.A.running, block.G.running))
    torch.testing.assert_close(factors[0], factors[1], rtol=0, atol=0)


def test_only_the_eigen_method_drops_eigenvalues_and_only_of_two_dense_ungrouped_factors() -> None:
    a, g = Factor(3, torch.float64, torch.device("cpu")), Factor(2, torch.float64, torch.device("cpu"))
    a.running.copy_(torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)))
    g.running.copy_(torch.diag(torch.tensor([4.0, 5.0], dtype=torch.float64)))
    assert Eigen().rank_thresholds(a, g, 0.1) == (linalg.rank_threshold(0.1, 9.0), linalg.rank_threshold(0.1, 6.0))
    assert DampedInverse().rank_thresholds(a, g, 0.1) == (None, None)
    diagonal = DiagonalFactor(3, torch.float64, torch.device("cpu"))
    grouped = Factor(3, torch.float64, torch.device("cpu"), groups=2)
    assert Eigen().rank_thresholds(diagonal, g, 0.1) == (None, None)
    assert Eigen().rank_thresholds(grouped, g, 0.1) == (None, None)

