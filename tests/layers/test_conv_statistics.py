"""Convolution statistics kinds (``layers.conv_statistics``) against dense references from first principles.

References: patches taken position by position from the input padded as the layer pads it
(explicit slicing, any number of spatial dims), per-sample output-gradients from autograd on each
sample's own loss, and the docs/numerics.md formulas written out: "expand" every position a row,
"reduce" one row per sample (mean patch, summed ĝ), sampled positions (the documented subset,
``G`` scaled by L/m).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from helpers import kron_solve
from torch import nn

from kfac_optim import KFAC, CurvatureConfig
from kfac_optim.layers import ConvStatistics, Expand, Reduce, ReduceAbove, SampledPositions

GEOMETRIES = [
    (nn.Conv2d, {"kernel_size": 3, "padding": 1, "bias": True}, (7, 6)),
    (nn.Conv2d, {"kernel_size": 3, "stride": 2, "padding": 1, "bias": False}, (7, 6)),
    (nn.Conv2d, {"kernel_size": (2, 3), "stride": (1, 2), "padding": (2, 1), "dilation": (2, 1), "bias": True}, (7, 6)),
    (nn.Conv2d, {"kernel_size": 3, "padding": "same", "dilation": 2, "bias": False}, (6, 5)),
    (nn.Conv2d, {"kernel_size": 3, "padding": 1, "padding_mode": "reflect", "bias": True}, (6, 5)),
    (nn.Conv1d, {"kernel_size": 3, "stride": 2, "padding": 2, "dilation": 2, "bias": True}, (11,)),
    (nn.Conv3d, {"kernel_size": (2, 3, 2), "stride": (2, 1, 1), "padding": 1, "bias": False}, (4, 3, 3)),
]


@pytest.fixture(autouse=True)
def _in_float64() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def conv_rows_by_position(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``(N, L, C·prod(kernel))``: each output position's patch, sliced from the padded input."""
    if conv.padding_mode == "zeros":
        padded = F.pad(x, conv._reversed_padding_repeated_twice)
    else:
        padded = F.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
    spans = [d * (k - 1) + 1 for k, d in zip(conv.kernel_size, conv.dilation, strict=True)]
    outputs = [(size - span) // s + 1 for size, span, s in zip(padded.shape[2:], spans, conv.stride, strict=True)]
    rows = []
    for position in itertools.product(*(range(o) for o in outputs)):
        window = tuple(slice(o * s, o * s + span, d)
                       for o, s, span, d in zip(position, conv.stride, spans, conv.dilation, strict=True))
        rows.append(padded[(slice(None), slice(None), *window)].reshape(x.shape[0], -1))
    return torch.stack(rows, 1)


def per_sample_conv_output_grads(conv: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``(N, L, C_out)``: ĝ, the gradient of each sample's own loss w.r.t. its output positions."""
    out = conv(x)
    grads = []
    for n in range(x.shape[0]):
        (grad,) = torch.autograd.grad(0.5 * ((out[n] - target[n]) ** 2).sum(), out, retain_graph=True)
        grads.append(grad[n].reshape(out.shape[1], -1).T)
    return torch.stack(grads)


def step_with_conv_statistics(conv: nn.Module, x: torch.Tensor, target: torch.Tensor,
                              statistics: ConvStatistics | None,
                              **curvature) -> tuple[KFAC, torch.Tensor, torch.Tensor]:
    """One K-FAC step (lr 1, no clip, λ = 0.1) on a copy of ``conv``: the optimizer, the joint
    gradient and the applied direction."""
    conv = copy.deepcopy(conv)
    config = CurvatureConfig(conv_positions=statistics, factor_dtype=torch.float64,
                             inv_dtype=torch.float64, **curvature)
    optimizer = KFAC(conv, lr=1.0, kl_clip=None, damping=0.1, factor_update_steps=1, decomposition_update_steps=10,
                     curvature=config)
    joint = lambda: torch.cat([p.detach().reshape(conv.weight.shape[0], -1)  # noqa: E731
                               for p in optimizer.blocks[0].parameters()], 1)
    before = joint()
    (0.5 * ((conv(x) - target) ** 2).flatten(1).sum(1).mean()).backward()
    grad = torch.cat([p.grad.reshape(conv.weight.shape[0], -1) for p in optimizer.blocks[0].parameters()], 1)
    optimizer.step()
    return optimizer, grad, before - joint()


def check_factors_and_step(conv: nn.Module, x: torch.Tensor, target: torch.Tensor, statistics: ConvStatistics,
                           a_rows: torch.Tensor, g_rows: torch.Tensor, g_scale: float = 1.0) -> None:
    """The step builds ``A = mean a aᵀ`` over ``a_rows (N, R, ·)``, ``G = g_scale/N Σ ĝ ĝᵀ`` over
    ``g_rows (N, R, C_out)``, and moves by ``(G ⊗ A + λI)⁻¹ ∇``."""
    if conv.bias is not None:
        a_rows = torch.cat([a_rows, torch.ones(*a_rows.shape[:2], 1)], -1)
    a, g = a_rows.reshape(-1, a_rows.shape[-1]), g_rows.reshape(-1, g_rows.shape[-1])
    A_ref, G_ref = a.T @ a / len(a), g_scale * g.T @ g / x.shape[0]
    optimizer, grad, direction = step_with_conv_statistics(conv, x, target, statistics)
    block = optimizer.blocks[0]
    torch.testing.assert_close(block.A.running, A_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block.G.running, G_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(direction, kron_solve(G_ref, A_ref, grad, 0.1), rtol=1e-9, atol=1e-12)


def conv_case(kind: type[nn.Module], args: dict,
              spatial: tuple[int, ...]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    conv = kind(2, 3, **args)
    x = torch.randn(3, 2, *spatial)
    return conv, x, torch.randn_like(conv(x))


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(("kind", "args", "spatial"), GEOMETRIES)
def test_reduce_is_the_mean_patch_and_the_summed_output_gradient(kind, args, spatial) -> None:
    """Eschenhagen et al.'s K-FAC-reduce: a_n = (1/L) Σ_l a_{n,l}, ĝ_n = Σ_l ĝ_{n,l}, A, G = (1/N) Σ_n."""
    conv, x, target = conv_case(kind, args, spatial)
    a = conv_rows_by_position(conv, x).mean(1, keepdim=True)
    g = per_sample_conv_output_grads(conv, x, target).sum(1, keepdim=True)
    check_factors_and_step(conv, x, target, Reduce(), a, g)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(("kind", "args", "spatial"), GEOMETRIES)
def test_expand_spelled_out_is_every_position_a_row(kind, args, spatial) -> None:
    conv, x, target = conv_case(kind, args, spatial)
    a, g = conv_rows_by_position(conv, x), per_sample_conv_output_grads(conv, x, target)
    check_factors_and_step(conv, x, target, Expand(), a, g)


@pytest.mark.parametrize(("kind", "args", "spatial"), [GEOMETRIES[i] for i in (0, 1, 2, 5, 6)])
def test_sampled_positions_are_the_seeded_subset_with_g_scaled_by_positions_over_count(kind, args, spatial) -> None:
    """S = the first m of ``torch.randperm(L)`` drawn from a generator seeded with ``seed``, sorted;
    A = mean over the N·m sampled rows, G = (L/m)·(1/N) Σ over them."""
    conv, x, target = conv_case(kind, args, spatial)
    a, g = conv_rows_by_position(conv, x), per_sample_conv_output_grads(conv, x, target)
    positions, count = a.shape[1], 5
    chosen = torch.randperm(positions, generator=torch.Generator().manual_seed(7))[:count].sort().values
    check_factors_and_step(conv, x, target, SampledPositions(count, seed=7), a[:, chosen], g[:, chosen],
                           g_scale=positions / count)


def test_sampled_positions_are_the_same_in_every_run_and_change_with_the_seed() -> None:
    conv, x, target = conv_case(*GEOMETRIES[0])
    factors = [step_with_conv_statistics(conv, x, target, SampledPositions(6, seed))[0].blocks[0].A.running
               for seed in (3, 3, 4)]
    torch.testing.assert_close(factors[0], factors[1], rtol=0, atol=0)
    assert not torch.allclose(factors[0], factors[2])


def test_sampled_positions_with_no_fewer_positions_than_count_is_expand() -> None:
    conv, x, target = conv_case(*GEOMETRIES[1])  # 4x3 outputs: 12 positions
    sampled = step_with_conv_statistics(conv, x, target, SampledPositions(12))[0].blocks[0]
    expand = step_with_conv_statistics(conv, x, target, Expand())[0].blocks[0]
    for name in ("A", "G"):
        torch.testing.assert_close(sampled.factors[name].running, expand.factors[name].running, rtol=1e-12, atol=1e-12)


def test_reduce_above_reduces_only_layers_with_more_output_positions_than_its_threshold() -> None:
    """A 7x6 map (42 positions) and a 4x3 one (12) behind it: ReduceAbove(20) reduces the first,
    expands the second, each as that kind alone would (and says so in ``describe()``)."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, stride=2, padding=1))
    x = torch.randn(3, 2, 7, 6)
    target = torch.randn_like(model(x))
    runs = {}
    for statistics in (ReduceAbove(20), Reduce(), Expand()):
        copy = nn.Sequential(*(nn.Conv2d(m.in_channels, m.out_channels, 3, m.stride, 1) for m in model))
        copy.load_state_dict(model.state_dict())
        optimizer = KFAC(copy, lr=1.0, factor_update_steps=1, decomposition_update_steps=10,
                         curvature=CurvatureConfig(conv_positions=statistics, factor_dtype=torch.float64))
        F.mse_loss(copy(x), target).backward()
        optimizer.step()
        runs[statistics] = optimizer.blocks
    rule = runs[ReduceAbove(20)]
    for block, alone in ((rule[0], runs[Reduce()][0]), (rule[1], runs[Expand()][1])):
        for name in ("A", "G"):
            torch.testing.assert_close(block.factors[name].running, alone.factors[name].running, rtol=1e-12, atol=0)
    assert "ReduceAbove(positions=20)" in rule[0].describe()


def test_conv_statistics_override_weight_sharing_for_convs_only() -> None:
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Flatten(0), nn.Linear(3 * 25, 2))
    optimizer = KFAC(model, lr=0.1, curvature=CurvatureConfig(weight_sharing="reduce", conv_positions=Expand()))
    conv, linear = optimizer.blocks
    assert isinstance(conv.statistics, Expand) and not conv.reduce and linear.reduce
    optimizer.remove_hooks()
    default = KFAC(model, lr=0.1, curvature=CurvatureConfig(weight_sharing="reduce")).blocks[0]
    assert isinstance(default.statistics, Reduce) and "statistics Reduce()" in default.describe()


def test_bad_conv_statistics_are_named() -> None:
    with pytest.raises(TypeError, match="CurvatureConfig.conv_positions"):
        CurvatureConfig(conv_positions="reduce")
    with pytest.raises(ValueError, match="SampledPositions.count"):
        SampledPositions(0)
    with pytest.raises(TypeError, match="SampledPositions.seed"):
        SampledPositions(4, seed=1.5)
    with pytest.raises(ValueError, match="ReduceAbove.positions"):
        ReduceAbove(-1)


def test_the_counted_step_cost_is_the_forward_s_whatever_rows_the_statistics_make() -> None:
    """The automatic intervals count the SGD-equivalent step from the rows the conv's forward
    multiplied (N·L), so ``Reduce`` (N rows of statistics) leaves it unchanged and counts less
    statistics work than ``Expand``, but not less than reading every position once."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 12 * 12, 2))
    x, y = torch.randn(4, 3, 12, 12), torch.randint(0, 2, (4,))
    costs = {}
    for statistics in (Expand(), Reduce()):
        copy_ = copy.deepcopy(model)
        optimizer = KFAC(copy_, lr=0.1, curvature=CurvatureConfig(conv_positions=statistics))
        F.cross_entropy(copy_(x), y).backward()
        optimizer.step()
        costs[statistics] = optimizer.estimator.intervals.costs
    expand, reduce = costs[Expand()], costs[Reduce()]
    assert reduce.step == expand.step
    assert reduce.decomposition == expand.decomposition
    assert reduce.factor < expand.factor
