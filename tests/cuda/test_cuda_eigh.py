"""The eigendecomposition of a wide factor on CUDA (``pytest -m cuda``; skipped without CUDA):
ResNet-50's widest, the 4608 columns of a 3x3 conv over 512 channels. Each test prints its time
(``pytest -rP`` shows it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from kfac_optim import linalg
from tests.cuda_helpers import cuda_test_device, cuda_test_marks

pytestmark = cuda_test_marks()

WIDTH = 4608


def wide_factor() -> Tensor:
    """A full-rank float32 PSD factor ``(WIDTH, WIDTH)``: the Gram matrix of ``WIDTH + 512`` Gaussian
    rows over their count, made on the test device."""
    generator = torch.Generator(device=cuda_test_device()).manual_seed(0)
    rows = torch.randn(WIDTH + 512, WIDTH, generator=generator, device=cuda_test_device())
    return rows.T @ rows / len(rows)


def timed(work: Callable[[], Any]) -> tuple[Any, float]:
    """``work()`` and its seconds, the device synchronized before and after."""
    synchronize = torch.cuda.synchronize if cuda_test_device().type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    result = work()
    synchronize()
    return result, time.perf_counter() - start


def assert_decomposes(eigen: linalg.Eigen, factor: Tensor) -> None:
    """``Q diag(d) Qᵀ`` is ``factor`` and ``Q`` orthonormal, to float32 rounding (eps 1.2e-7) grown over
    ``WIDTH``-long sums: ``1e-4`` of ``factor``'s norm, ``1e-3`` per entry of ``QᵀQ − I``."""
    assert eigen.Q.dtype is eigen.d.dtype is torch.float32
    assert eigen.Q.shape == (WIDTH, WIDTH) and eigen.Q.device == factor.device
    reconstructed = (eigen.Q * eigen.d) @ eigen.Q.T
    assert float(torch.linalg.matrix_norm(reconstructed - factor) / torch.linalg.matrix_norm(factor)) < 1e-4
    identity = torch.eye(WIDTH, device=factor.device)
    assert float((eigen.Q.T @ eigen.Q - identity).abs().max()) < 1e-3


def test_eigh_of_a_4608_wide_factor_on_cuda() -> None:
    factor = wide_factor()
    eigen, seconds = timed(lambda: linalg.symmetric_eigen(factor, torch.float32))
    print(f"eigh of a {WIDTH}x{WIDTH} float32 factor on {factor.device}: {seconds:.2f} s")  # noqa: T201 (the figure asked for)
    assert eigen is not None
    assert_decomposes(eigen, factor)


def test_a_failed_float32_eigh_of_a_4608_wide_factor_is_retried_in_float64_on_cuda(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """``torch.linalg.eigh`` made to fail in float32 (as cuSOLVER's ``syevd`` can, not converging):
    ``linalg`` retries in float64, and returns the decomposition in float32."""
    real_eigh = torch.linalg.eigh
    dtypes: list[torch.dtype] = []

    def eigh_failing_in_float32(matrix: Tensor, *args: Any, **kwargs: Any) -> Any:
        dtypes.append(matrix.dtype)
        if matrix.dtype is torch.float32:
            raise torch.linalg.LinAlgError("linalg.eigh: the algorithm failed to converge (made to fail)")
        return real_eigh(matrix, *args, **kwargs)

    factor = wide_factor()
    monkeypatch.setattr(torch.linalg, "eigh", eigh_failing_in_float32)
    eigen, seconds = timed(lambda: linalg.symmetric_eigen(factor, torch.float32))
    print(f"eigh of a {WIDTH}x{WIDTH} factor on {factor.device}, float32 failed, float64 retry: {seconds:.2f} s")  # noqa: T201
    assert dtypes == [torch.float32, torch.float64]
    assert eigen is not None
    assert_decomposes(eigen, factor)
