"""The K-FAC step on CUDA computes what it computes on the CPU (``pytest -m cuda``; skipped without CUDA).

The control is the same loop on the CPU in float64 (model, factors and decompositions): the
reference the CUDA run is compared with, parameter by parameter, after steps that fold, decompose
(every second step) and precondition.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from kfac_optim import KFAC, CurvatureConfig
from tests.cuda_helpers import (
    cpu_copies,
    cuda_check_batch,
    cuda_check_net,
    cuda_test_device,
    cuda_test_marks,
    deterministic_kernels,
)

pytestmark = cuda_test_marks()

STEP_OPTIONS: dict[str, Any] = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.1, factor_update_steps=1,
                                    decomposition_update_steps=2)
CHECK_STEPS = 5


def trained_parameters(device: torch.device, dtype: torch.dtype) -> dict[str, Tensor]:
    """:class:`CudaCheckNet` after ``CHECK_STEPS`` K-FAC steps on ``device`` with the model, the
    factors and the decompositions in ``dtype``; the parameters, on the CPU."""
    model = cuda_check_net(device, dtype)
    curvature = CurvatureConfig(factor_dtype=dtype, inv_dtype=dtype)
    optimizer = KFAC(model, curvature=curvature, **STEP_OPTIONS)
    for step in range(CHECK_STEPS):
        x, y = cuda_check_batch(step, device, dtype)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert optimizer.steps == CHECK_STEPS
    assert all(bool(f.initialized) for b in optimizer.blocks for f in b.factors.values())
    return cpu_copies(dict(model.named_parameters()))


def cpu_float64_reference() -> dict[str, Tensor]:
    return trained_parameters(torch.device("cpu"), torch.float64)


def test_the_float64_step_on_cuda_equals_the_cpu_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tolerance ``rtol=1e-9, atol=1e-12``: float64 rounding (eps 2.2e-16) differs between the
    devices' kernels (cuBLAS and cuSOLVER against MKL/OpenBLAS and LAPACK), and the damped solve
    amplifies it by at most about ``λ_max/λ`` (≤ 1e3 here, damping 0.1); an actual difference
    (stale or unsynchronized data, a step on the wrong tensors) moves a parameter by about
    ``lr·|direction|`` ≈ 1e-3."""
    deterministic_kernels(monkeypatch)
    actual = trained_parameters(cuda_test_device(), torch.float64)
    torch.testing.assert_close(actual, cpu_float64_reference(), rtol=1e-9, atol=1e-12)


def test_the_float32_step_on_cuda_is_within_float32_rounding_of_the_float64_cpu_step(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default precision (float32 model and factors), TF32 off. Tolerance ``rtol=1e-4, atol=1e-5``:
    float32's eps (1.2e-7) amplified by the damped solve (≤ 1e3) over five steps."""
    deterministic_kernels(monkeypatch)
    actual = trained_parameters(cuda_test_device(), torch.float32)
    expected = {name: p.float() for name, p in cpu_float64_reference().items()}
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_the_optimizer_state_lives_on_the_parameters_device() -> None:
    device = cuda_test_device()
    model = cuda_check_net(device)
    optimizer = KFAC(model, **STEP_OPTIONS)
    x, y = cuda_check_batch(0, device)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    devices = {f.running.device for b in optimizer.blocks for f in b.factors.values()}
    devices |= {f.decomposition.Q.device for b in optimizer.blocks for f in b.factors.values()}
    devices |= {s["momentum_buffer"].device for s in optimizer.state.values()}
    assert devices == {next(model.parameters()).device}
