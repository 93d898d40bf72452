"""Native mixed precision on CUDA (``pytest -m cuda``; skipped without CUDA): fp16 autocast with
``torch.amp.GradScaler("cuda")``, and bf16 autocast. The CUDA counterpart of
tests/integration/test_amp.py; each test compares a run with a control run (another loss scale,
fp32, or the state before the step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import running_factors
from torch import Tensor, nn

from kfac_optim import KFAC
from tests.cuda_helpers import cuda_check_batch, cuda_check_net, cuda_test_device, cuda_test_marks

pytestmark = cuda_test_marks()

AMP_OPTIONS: dict[str, Any] = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.1, factor_update_steps=1,
                                   decomposition_update_steps=2)


def cuda_amp_run(steps: int, dtype: torch.dtype | None = torch.float16,
                 init_scale: float | None = 2.0**16) -> tuple[nn.Module, KFAC, torch.amp.GradScaler | None]:
    """``steps`` steps on the test device under autocast in ``dtype`` (None: fp32), with a
    ``GradScaler`` at ``init_scale`` (None: none)."""
    device = cuda_test_device()
    model = cuda_check_net(device)
    optimizer = KFAC(model, **AMP_OPTIONS)
    scaler = None if init_scale is None else torch.amp.GradScaler(device.type, init_scale=init_scale)
    for step in range(steps):
        cuda_amp_step(model, optimizer, scaler, step, dtype)
    return model, optimizer, scaler


def cuda_amp_step(model: nn.Module, optimizer: KFAC, scaler: torch.amp.GradScaler | None, step: int,
                  dtype: torch.dtype | None, poison: bool = False) -> None:
    """One step on batch ``step``; ``poison``: a NaN in one gradient entry after the backward (an overflow)."""
    device = cuda_test_device()
    x, y = cuda_check_batch(step, device)
    optimizer.zero_grad()
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = F.cross_entropy(model(x).float(), y)
    if scaler is None:
        loss.backward()
        optimizer.step()
        return
    scaler.scale(loss).backward()
    if poison:
        model.fc1.weight.grad[0, 0] = float("nan")
    scaler.step(optimizer)
    scaler.update()


def cuda_step_state(model: nn.Module, optimizer: KFAC) -> dict[str, Any]:
    """Everything a step may change, on the CPU: parameters, momentum, factors, decompositions, step count."""
    state: dict[str, Any] = {f"param.{n}": p.detach().cpu().clone() for n, p in model.named_parameters()}
    for index, s in enumerate(optimizer.state.values()):
        state[f"momentum.{index}"] = s["momentum_buffer"].cpu().clone()
    for block in optimizer.blocks:
        for name, factor in block.factors.items():
            state[f"{block.name}.{name}"] = factor.running.cpu().clone()
            state[f"{block.name}.{name}.initialized"] = factor.initialized.cpu().clone()
            if factor.decomposition is not None:
                state[f"{block.name}.{name}.Q"] = factor.decomposition.Q.cpu().clone()
    state["steps"] = optimizer.steps
    return state


def cuda_params(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def test_an_fp16_overflow_step_on_cuda_is_skipped_with_all_state_untouched() -> None:
    model, optimizer, scaler = cuda_amp_run(3)
    before, scale = cuda_step_state(model, optimizer), scaler.get_scale()
    cuda_amp_step(model, optimizer, scaler, 3, torch.float16, poison=True)
    torch.testing.assert_close(cuda_step_state(model, optimizer), before, rtol=0, atol=0)
    assert all(block.pending_samples == 0 for block in optimizer.blocks)
    assert scaler.get_scale() == scale / 2


def test_fp16_factors_and_updates_on_cuda_do_not_depend_on_the_loss_scale() -> None:
    """Loss scales 2⁸ and 2¹⁶ (powers of two: the scaled fp16 gradients differ only in their
    exponents); tolerances of tests/integration/test_amp.py."""
    model_low, opt_low, _ = cuda_amp_run(4, init_scale=2.0**8)
    model_high, opt_high, _ = cuda_amp_run(4, init_scale=2.0**16)
    assert opt_low.steps == opt_high.steps == 4
    factors_low = {k: v.cpu() for k, v in running_factors(opt_low).items()}
    factors_high = {k: v.cpu() for k, v in running_factors(opt_high).items()}
    torch.testing.assert_close(factors_low, factors_high, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(cuda_params(model_low), cuda_params(model_high), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("dtype", "init_scale", "tolerance"),
    [
        (torch.float16, 2.0**16, dict(rtol=2e-2, atol=2e-3)),  # fp16 with a GradScaler
        (torch.bfloat16, None, dict(rtol=5e-2, atol=1e-2)),  # bf16, no scaler
    ],
    ids=["fp16-scaler", "bf16"],
)
def test_autocast_on_cuda_is_close_to_fp32_with_fp32_factors(dtype: torch.dtype, init_scale: float | None,
                                                             tolerance: dict[str, float]) -> None:
    """Tolerances of tests/integration/test_amp.py: fp16's 11-bit and bf16's 8-bit mantissas."""
    model_amp, opt_amp, _ = cuda_amp_run(4, dtype=dtype, init_scale=init_scale)
    model_fp32, opt_fp32, _ = cuda_amp_run(4, dtype=None, init_scale=None)
    reference = running_factors(opt_fp32)
    for name, factor in running_factors(opt_amp).items():
        assert factor.dtype is torch.float32
        torch.testing.assert_close(factor.cpu(), reference[name].cpu(), **tolerance)
    torch.testing.assert_close(cuda_params(model_amp), cuda_params(model_fp32), **tolerance)
