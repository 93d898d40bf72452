"""Convolutions whose kernel taps read only zero padding (ResNet's layer4 on 32 px images).

Those taps' patch columns are zero in every row, so ``ConvBlock`` leaves them out of the Gram and
``Factor.fold`` folds only the block that can be nonzero. The factors must be those of the whole
unfold: checked against rows sliced from the padded input position by position, an explicit Gram
and an explicit running average (float64), and a whole optimizer run against the same run with the
skip switched off.
"""

from __future__ import annotations

import pytest
import torch
from test_factors import _float64  # noqa: F401 (autouse fixture)
from test_layers import conv_patches_nd
from torch import nn

from kfac_optim import KFAC, CurvatureConfig
from kfac_optim.layers import ConvBlock
from kfac_optim.layers import conv as conv_module
from kfac_optim.layers.factor import Support

DECAY = 0.9


@pytest.fixture
def any_box(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip the zero taps for any number of valid taps (by default only for one, see MAX_VALID_TAPS)."""
    monkeypatch.setattr(conv_module, "MAX_VALID_TAPS", 27)


def reference_rows(conv: nn.Module, x: torch.Tensor, bias: bool) -> torch.Tensor:
    """``(groups, N·L, C_in/g·prod(kernel) [+1])``: every patch row of each group, a trailing 1 for a bias."""
    rows = conv_patches_nd(conv, x)
    per_group = rows.view(len(rows), conv.groups, -1).transpose(0, 1)
    if bias:
        per_group = torch.cat([per_group, torch.ones(*per_group.shape[:2], 1)], 2)
    return per_group


def as_storage(matrices: torch.Tensor, groups: int) -> torch.Tensor:
    """A factor's storage: ``(n, n)`` for one group, ``(groups, n, n)`` otherwise."""
    return matrices[0] if groups == 1 else matrices


def indices_of(support: Support, dim: int) -> set[int]:
    """The indices a support holds: those whose diagonal entry it zeroes."""
    marked = torch.ones(dim, dim)
    support.zero(marked)
    return set(torch.nonzero(marked.diagonal() == 0).squeeze(1).tolist())


def record(block: ConvBlock, conv: nn.Module, x: torch.Tensor) -> None:
    """Accumulate one batch into ``block`` with a random output-gradient."""
    block.accumulate(x, torch.randn_like(conv(x)))


# ResNet-18's layer4 at 32 px: 3x3 convs over 1x1 maps (8 of 9 taps are padding), layer4.0.conv1
# over 2x2 with stride 2 (4 of 9 valid); then groups, dilation, 'same', 1-d and 3-d variants.
GEOMETRIES = [
    (nn.Conv2d, {"kernel_size": 3, "padding": 1}, (6, 1, 1)),
    (nn.Conv2d, {"kernel_size": 3, "padding": 1, "stride": 2}, (6, 2, 2)),
    (nn.Conv2d, {"kernel_size": 3, "padding": 1, "groups": 2}, (6, 1, 1)),
    (nn.Conv2d, {"kernel_size": 3, "padding": 1, "stride": 2, "groups": 3}, (6, 2, 2)),
    (nn.Conv2d, {"kernel_size": 3, "padding": 2, "dilation": 2}, (6, 2, 3)),
    (nn.Conv2d, {"kernel_size": 3, "padding": "same", "dilation": 3}, (6, 3, 2)),
    (nn.Conv1d, {"kernel_size": 5, "padding": 3, "stride": 2}, (6, 2)),
    (nn.Conv3d, {"kernel_size": 3, "padding": 1}, (3, 1, 2, 3)),
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("conv_type, conv_args, shape", GEOMETRIES)
@pytest.mark.usefixtures("any_box")
def test_pending_and_running_factors_equal_the_dense_patch_reference(conv_type, conv_args, shape, bias) -> None:
    torch.manual_seed(0)
    conv = conv_type(shape[0], 6, bias=bias, **conv_args)
    block = ConvBlock("conv", conv, include_bias=bias, factor_dtype=torch.float64)
    batches = [torch.randn(4, *shape), torch.randn(3, *shape)]
    running = None
    for x in batches:
        record(block, conv, x)
        rows = reference_rows(conv, x, bias)
        gram = rows.mT @ rows
        assert block.A.pending_support is not None and block.A.pending_support.size < block.A.dim  # columns skipped
        torch.testing.assert_close(block.A.pending, as_storage(gram, conv.groups), rtol=1e-12, atol=1e-12)
        block.fold(DECAY, "mean")
        batch = gram / rows.shape[1]
        running = batch if running is None else DECAY * running + (1 - DECAY) * batch
        torch.testing.assert_close(block.A.running, as_storage(running, conv.groups), rtol=1e-12, atol=1e-12)
        assert not block.A.pending.any()


@pytest.mark.usefixtures("any_box")
@pytest.mark.parametrize(
    "conv_args",
    [
        {"kernel_size": 3, "padding": 1, "padding_mode": "circular"},  # the padding is data, not zeros
        {"kernel_size": 3, "padding": 5, "stride": 10},  # no tap reads inside: all-zero patches
    ],
)
def test_geometries_without_zero_taps_to_skip_take_the_dense_path(conv_args) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, **conv_args)
    block = ConvBlock("conv", conv, include_bias=True, factor_dtype=torch.float64)
    x = torch.randn(4, 3, 1, 1)
    record(block, conv, x)
    rows = reference_rows(conv, x, bias=True)[0]
    assert block.A.pending_support is None
    torch.testing.assert_close(block.A.pending, rows.T @ rows, rtol=1e-12, atol=1e-12)


@pytest.mark.usefixtures("any_box")
def test_reduce_mode_skips_the_zero_taps_exactly() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 5, 3, padding=1, stride=2)
    block = ConvBlock("conv", conv, include_bias=True, factor_dtype=torch.float64)
    block.reduce = True
    x = torch.randn(5, 4, 2, 2)
    record(block, conv, x)
    patches = reference_rows(conv, x, bias=False)[0].view(5, -1, 36)  # one output position per sample
    rows = torch.cat([patches.mean(1), torch.ones(5, 1)], 1)
    assert block.A.pending_support is not None
    torch.testing.assert_close(block.A.pending, rows.T @ rows, rtol=1e-12, atol=1e-12)


@pytest.mark.usefixtures("any_box")
def test_a_growing_input_size_grows_the_support_and_stays_exact() -> None:
    """1x1 maps (the center tap), 2x2 (four taps), both in one pending sum, then 3x3 (every tap)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1, stride=2)
    block = ConvBlock("conv", conv, include_bias=True, factor_dtype=torch.float64)
    running, sizes_seen = None, []
    for sizes in ([1], [2], [1, 2], [3], [1]):
        grams, count = 0, 0
        for size in sizes:
            x = torch.randn(4, 3, size, size)
            record(block, conv, x)
            rows = reference_rows(conv, x, bias=True)[0]
            grams, count = grams + rows.T @ rows, count + len(rows)
        block.fold(DECAY, "mean")
        sizes_seen += sizes
        batch = grams / count
        running = batch if running is None else DECAY * running + (1 - DECAY) * batch
        torch.testing.assert_close(block.A.running, running, rtol=1e-12, atol=1e-12)
        nonzero = set(torch.nonzero(running.diagonal()).squeeze(1).tolist())
        support = block.A.support
        if 3 not in sizes_seen:  # only the valid taps' columns (and the bias) so far
            assert support is not None and indices_of(support, block.A.dim) == nonzero
    assert block.A.support is None  # since the 3x3 batch, whose patches have every column


def test_a_skipped_fold_discards_a_non_finite_batch_and_resets_a_non_finite_factor() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    block = ConvBlock("conv", conv, include_bias=True, factor_dtype=torch.float64)
    record(block, conv, torch.randn(2, 3, 1, 1))
    block.fold(DECAY, "mean")
    before = block.A.running.clone()
    record(block, conv, torch.full((2, 3, 1, 1), float("inf")))
    block.fold(DECAY, "mean")
    assert torch.equal(block.A.running, before) and int(block.A.discarded) == 1
    block.A.running[4, 4] = float("nan")  # channel 0's center tap: inside the support
    x = torch.randn(2, 3, 1, 1)
    record(block, conv, x)
    block.fold(DECAY, "mean")
    rows = reference_rows(conv, x, bias=True)[0]
    torch.testing.assert_close(block.A.running, rows.T @ rows / len(rows), rtol=1e-12, atol=1e-12)


def test_a_loaded_or_globally_averaged_factor_folds_whole() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    block = ConvBlock("conv", conv, include_bias=True, factor_dtype=torch.float64)
    record(block, conv, torch.randn(2, 3, 1, 1))
    block.fold(DECAY, "mean")
    assert block.A.support is not None
    state = block.A.state_dict()
    running = torch.randn(block.A.dim, block.A.dim)
    running = running @ running.T  # nonzero outside the 1x1 support, as a loaded factor may be
    block.A.load_state_dict({**state, "running": block.A.packed(running)})  # saved as a factor saves it
    assert block.A.support is None
    x = torch.randn(2, 3, 1, 1)
    record(block, conv, x)
    rows = reference_rows(conv, x, bias=True)[0]
    block.fold(DECAY, "mean")
    torch.testing.assert_close(block.A.running, DECAY * running + (1 - DECAY) * rows.T @ rows / len(rows))
    block.A.set_global(block.A.running.clone(), torch.tensor(1), 0)
    assert block.A.support is None


def shrinking_net() -> nn.Sequential:
    """Feature maps 4x4 → 2x2 → 1x1 → 1x1: the last two 3x3 convs see mostly padding."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


def zero_taps_train(skip: bool,
                    monkeypatch: pytest.MonkeyPatch) -> tuple[list[torch.Tensor], list[torch.Tensor], list[bool]]:
    """Five K-FAC steps of :func:`shrinking_net`: its parameters, A factors, and which convs skipped taps."""
    monkeypatch.setattr(ConvBlock, "skip_zero_taps", skip)
    torch.manual_seed(0)
    net = shrinking_net()
    optimizer = KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=2,
                     curvature=CurvatureConfig(factor_dtype=torch.float64))
    for _ in range(5):
        x, y = torch.randn(8, 3, 4, 4), torch.randint(0, 3, (8,))
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    convs = [block for block in optimizer.blocks if isinstance(block, ConvBlock)]
    skipped = [block.A.support is not None and block.A.support.size < block.A.dim for block in convs]
    return [p.detach().clone() for p in net.parameters()], [b.A.running for b in optimizer.blocks], skipped


@pytest.mark.parametrize("max_valid_taps", [1, 27])
def test_an_optimizer_steps_the_same_with_and_without_skipping_zero_taps(
    max_valid_taps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(conv_module, "MAX_VALID_TAPS", max_valid_taps)
    params_skip, factors_skip, skipped = zero_taps_train(True, monkeypatch)
    params_dense, factors_dense, skipped_dense = zero_taps_train(False, monkeypatch)
    # 4x4 and 2x2 inputs use every tap, 2x2 with stride 2 four of them, 1x1 one.
    assert skipped == [False, False, max_valid_taps >= 4, True]
    assert not any(skipped_dense)
    for with_skip, dense in zip(factors_skip, factors_dense, strict=True):
        torch.testing.assert_close(with_skip, dense, rtol=1e-12, atol=1e-14)
    for with_skip, dense in zip(params_skip, params_dense, strict=True):
        torch.testing.assert_close(with_skip, dense, rtol=1e-10, atol=1e-12)
