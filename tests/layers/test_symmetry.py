"""Every dense running factor equals its transpose exactly after every fold (docs/numerics.md).

Checkpoints hold a factor's upper triangle, so a factor whose triangles differ by one rounding
resumes as another factor. Whether a BLAS kernel returns ``xᵀx`` exactly symmetric depends on
the machine (on AVX2 CPUs a 16x5 float32 ``addmm`` is not), so the tests below do not rely on it:
the first checks many shapes and dtypes as trained, the others feed the factors Gram sums made
asymmetric on purpose (skewed pending sums, an asymmetric all-reduced total) and require an
exactly symmetric factor and a bit-identical resume from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, CurvatureConfig, linalg
from kfac_optim.layers import LayerNormBlock
from kfac_optim.layers.factor import Factor

STEPS = 3


class SequenceNet(nn.Module):
    """(N, T, D) tokens → Linear → tanh → LayerNorm → MultiheadAttention → mean over T → Linear."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(23, width)
        self.fc = nn.Linear(width, 6)
        self.norm = nn.LayerNorm(6)
        self.attention = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.fc(self.embed(tokens))))
        return self.head(self.attention(h, h, h, need_weights=False)[0].mean(1))


def symmetry_linear_net(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 7), nn.Tanh(), nn.Linear(7, width), nn.Tanh(), nn.Linear(width, 3))


def symmetry_conv_net(channels: int) -> nn.Module:
    """A plain conv, a grouped one (one Kronecker pair per group: batched factors), a 1x1 conv."""
    return nn.Sequential(
        nn.Conv2d(channels, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, groups=2), nn.ReLU(),
        nn.Conv2d(6, 5, 1), nn.Flatten(), nn.LazyLinear(3),
    )


# (name, model builder, input builder(rows)): widths 1..300, row counts odd.
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor]]] = {
    **{f"linear{w}": (lambda w=w: symmetry_linear_net(w), lambda rows, w=w: torch.randn(rows, w))
       for w in (1, 2, 5, 9, 37, 130)},
    "linear300": (lambda: symmetry_linear_net(300), lambda rows: torch.randn(2 * rows + 1, 300)),
    "conv3": (lambda: symmetry_conv_net(3), lambda rows: torch.randn(rows, 3, 5, 5)),
    "conv130": (lambda: symmetry_conv_net(130), lambda rows: torch.randn(rows, 130, 4, 4)),
    "sequence9": (lambda: SequenceNet(9), lambda rows: torch.randint(0, 23, (rows, 5))),
}
ROWS = (7, 37)


def dense_factors(optimizer: KFAC) -> dict[str, Factor]:
    return {f"{block.name}.{name}": factor for block in optimizer.blocks for name, factor in block.factors.items()
            if not factor.diagonal}


def asymmetric(optimizer: KFAC) -> list[str]:
    """The dense factors whose running average is not exactly its transpose."""
    return [name for name, factor in dense_factors(optimizer).items()
            if not torch.equal(factor.running, factor.running.mT)]


def symmetry_build(case: str, dtype: torch.dtype, weight_sharing: str = "expand") -> tuple[nn.Module, KFAC]:
    torch.manual_seed(0)
    model = CASES[case][0]()
    model(CASES[case][1](3))  # materializes lazy layers
    model = model.to(dtype)
    curvature = CurvatureConfig(
        factor_decay=0.7, weight_sharing=weight_sharing,  # type: ignore[arg-type]
        factor_dtype=torch.float64 if dtype == torch.float64 else torch.float32,
        blocks={nn.LayerNorm: LayerNormBlock},
    )
    return model, KFAC(model, lr=0.01, factor_update_steps=1, decomposition_update_steps=2, damping=0.1,
                       curvature=curvature)


def symmetry_train_step(case: str, model: nn.Module, optimizer: KFAC, step: int, rows: int) -> None:
    torch.manual_seed(1000 + step)
    x = CASES[case][1](rows)
    x = x.to(next(model.parameters()).dtype) if x.is_floating_point() else x
    out = model(x)
    target = torch.randint(0, 3, (out.shape[0],))
    optimizer.zero_grad()
    F.cross_entropy(out.float(), target).backward()
    optimizer.step()


def skew_pending_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every dense pending sum asymmetric just before it is folded, as a BLAS kernel whose two
    triangles round differently would (far more than one rounding: 2⁻⁸ of the strict upper triangle)."""
    fold = Factor.fold

    def skewed_fold(self: Factor, scale: float | torch.Tensor, decay: float) -> None:
        if not self.diagonal and self.pending_rows:
            self.pending.add_(self.pending.triu(1), alpha=2.0**-8)
        fold(self, scale, decay)

    monkeypatch.setattr(Factor, "fold", skewed_fold)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_every_fold_leaves_each_dense_factor_exactly_symmetric(case: str, dtype: torch.dtype, rows: int) -> None:
    model, optimizer = symmetry_build(case, dtype)
    for step in range(STEPS):
        symmetry_train_step(case, model, optimizer, step, rows)
        assert dense_factors(optimizer) and asymmetric(optimizer) == [], step


@pytest.mark.parametrize("weight_sharing", ["expand", "reduce"])
@pytest.mark.parametrize("case", ["linear5", "linear130", "conv3", "conv130", "sequence9"])
def test_an_asymmetric_pending_sum_is_folded_into_an_exactly_symmetric_factor(
    case: str, weight_sharing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    skew_pending_sums(monkeypatch)
    model, optimizer = symmetry_build(case, torch.float32, weight_sharing)
    for step in range(STEPS):
        symmetry_train_step(case, model, optimizer, step, 7)
        assert asymmetric(optimizer) == [], step


@pytest.mark.parametrize("case", ["linear9", "conv3", "sequence9"])
def test_factors_folded_from_asymmetric_sums_resume_bit_identically(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved after three folds (the last decomposition one step old), loaded into a fresh optimizer:
    the same factors, bit for bit, and the same parameters and factors three steps on."""
    skew_pending_sums(monkeypatch)
    model, optimizer = symmetry_build(case, torch.float32)
    for step in range(STEPS):
        symmetry_train_step(case, model, optimizer, step, 7)
    resumed_model, resumed = symmetry_build(case, torch.float32)
    resumed_model.load_state_dict(model.state_dict())
    resumed.load_state_dict(optimizer.state_dict())
    for name, factor in dense_factors(resumed).items():
        assert torch.equal(factor.running, dense_factors(optimizer)[name].running), name
    for step in range(STEPS, 2 * STEPS):
        symmetry_train_step(case, model, optimizer, step, 7)
        symmetry_train_step(case, resumed_model, resumed, step, 7)
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    for name, factor in dense_factors(resumed).items():
        assert torch.equal(factor.running, dense_factors(optimizer)[name].running), name


@pytest.mark.parametrize("groups", [1, 3])
def test_an_asymmetric_all_reduced_total_becomes_an_exactly_symmetric_factor(groups: int) -> None:
    """``set_global``: the ranks' sum as a communicator may deliver it, its two triangles summed
    in different orders (a batched factor travels whole)."""
    factor = Factor(9, torch.float32, torch.device("cpu"), groups=groups)
    rows = torch.randn(groups, 5, 9)
    total = rows.mT @ rows
    total += torch.randn_like(total).triu(1) * 1e-3
    factor.set_global(total.squeeze(0), torch.tensor(2.0), 10)
    assert torch.equal(factor.running, factor.running.mT)


@pytest.mark.parametrize("shape", [(1, 1), (5, 5), (300, 300), (2, 7, 7)])
def test_mirror_upper_copies_each_upper_entry_bit_for_bit(shape: tuple[int, ...]) -> None:
    """Every entry becomes the upper triangle's at its position, bit for bit (inf and nan too), but
    that the diagonal tiles' entries come out plus 0.0 (a -0.0 there becomes +0.0): over one tile,
    several (300 > ``MIRROR_TILE``) and a batch."""
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(shape, generator=generator)
    special = torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), float("nan")])
    picks = torch.randint(0, matrix.numel(), (max(5, matrix.numel() // 7),), generator=generator)
    matrix.view(-1)[picks] = special[torch.arange(len(picks)) % len(special)]
    n = shape[-1]
    rows, columns = torch.arange(n)[:, None], torch.arange(n)[None, :]
    upper = matrix[..., rows.minimum(columns), rows.maximum(columns)]
    same_tile = rows // linalg.MIRROR_TILE == columns // linalg.MIRROR_TILE
    expected = torch.where(same_tile, upper + 0.0, upper)
    mirrored = linalg.mirror_upper_(matrix.clone())
    assert torch.equal(mirrored.view(torch.int32), expected.view(torch.int32))
