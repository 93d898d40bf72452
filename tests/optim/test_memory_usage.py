"""``KFAC.memory_usage()`` against the theoretical size of factors and decompositions (one process).

Per factor of dimension n, in the element size of its dtype: the running factor and the pending
statistics are n² each; an eigendecomposition is n·r + r (Q and d, r = n or, held thin, the
factor's rank r ≤ n/2: ``linalg.symmetric_eigen``); an inverse is n².
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, CurvatureConfig


def memory_model() -> nn.Module:
    # Factor dims: conv A = 2·3·3 = 18 (no bias), G = 4; linear A = 4·6·6 + 1 = 145, G = 3.
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


DIMS = (18, 4, 145, 3)
COLUMNS = (18, 4, 5, 3)  # eigen Q's columns after one batch of 5 samples: linear A has rank 5, held thin


def one_step(optimizer: KFAC, net: nn.Module) -> None:
    optimizer.zero_grad()
    F.cross_entropy(net(torch.randn(5, 2, 6, 6)), torch.tensor([0, 1, 2, 0, 1])).backward()
    optimizer.step()


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.float64])
def test_factors_and_pending_are_n_squared_before_any_decomposition(factor_dtype: torch.dtype) -> None:
    optimizer = KFAC(memory_model(), curvature=CurvatureConfig(factor_dtype=factor_dtype), factor_update_steps=1,
                     decomposition_update_steps=10)
    size = torch.finfo(factor_dtype).bits // 8
    usage = optimizer.memory_usage()
    assert usage["factors"] == sum(n * n for n in DIMS) * size
    assert usage["pending"] == sum(n * n for n in DIMS) * size
    assert usage["decompositions"] == 0
    assert usage["total"] == usage["factors"] + usage["pending"] + usage["decompositions"]


@pytest.mark.parametrize(
    "method, inv_dtype, per_factor",
    [
        ("eigen", torch.float32, lambda n, r: n * r + r),
        ("eigen", torch.float64, lambda n, r: n * r + r),
        ("inverse", torch.float32, lambda n, r: n * n),
        ("inverse", torch.float64, lambda n, r: n * n),
    ],
)
def test_decompositions_are_q_and_d_or_one_inverse_per_factor(method, inv_dtype, per_factor) -> None:
    net = memory_model()
    optimizer = KFAC(net, lr=0.01, method=method, curvature=CurvatureConfig(inv_dtype=inv_dtype), factor_update_steps=1,
                     decomposition_update_steps=10)
    one_step(optimizer, net)
    size = torch.finfo(inv_dtype).bits // 8
    usage = optimizer.memory_usage()
    assert usage["decompositions"] == sum(per_factor(n, r) for n, r in zip(DIMS, COLUMNS)) * size
    assert usage["factors"] == sum(n * n for n in DIMS) * 4
    assert usage["total"] == usage["factors"] + usage["pending"] + usage["decompositions"]
