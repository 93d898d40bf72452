"""``KFAC`` under NVIDIA Apex legacy amp (O1, O2), against the CPU stand-in in ``tests/apex_standin``.

The stand-in's docstring lists the Apex behaviours it models. Each test compares an Apex run with
a control: plain fp32 ``KFAC``, or an Apex run without the disturbance under test.

Marked ``apex`` (pytest.ini): plain ``pytest`` runs it, ``pytest -m "not apex"`` leaves out the
whole Apex stand-in suite.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest_apex import fake_apex, scaled_step  # noqa: F401  (fake_apex is a fixture)
from helpers import running_factors
from torch import Tensor, nn

from kfac_optim import KFAC, CurvatureConfig

OPTIONS: dict[str, Any] = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.1, decomposition_update_steps=2)
LEVELS = ["O1", "O2"]

pytestmark = pytest.mark.apex


def make_apex_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 12),
                         nn.Tanh(), nn.Linear(12, 3))


def teacher_batch(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(10 + step)
    x = torch.randn(32, 8, generator=generator)
    return x, (x @ torch.randn(8, 3, generator=generator)).argmax(dim=1)


def apex_setup(amp: ModuleType, opt_level: str) -> tuple[nn.Module, KFAC]:
    model = make_apex_mlp()
    return amp.initialize(model, KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS}),
                          opt_level=opt_level, verbosity=0)


def end_apex(amp: ModuleType) -> None:
    """Undo O1's patching of torch functions (an Apex run is over; a control or a new run follows).

    Apex itself is initialized once per process; a test that runs twice must tear down in between.
    """
    handle = getattr(amp._amp_state, "handle", None)
    if handle is not None:
        handle._deactivate()
        del amp._amp_state.handle


def fp32_control(steps: list[int]) -> tuple[nn.Module, KFAC]:
    model = make_apex_mlp()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    for step in steps:
        x, y = teacher_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model, optimizer




def owned_params(optimizer: KFAC) -> list[Tensor]:
    """The parameters the optimizer updates (O2: the fp32 masters), in param_groups order."""
    return [p.detach() for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.parametrize("opt_level", LEVELS)
def test_training_follows_fp32_kfac(fake_apex: ModuleType, opt_level: str) -> None:
    model, optimizer = apex_setup(fake_apex, opt_level)
    losses = [scaled_step(fake_apex, model, optimizer, *teacher_batch(step)) for step in range(6)]
    end_apex(fake_apex)
    control_model, control = fp32_control(list(range(6)))
    assert optimizer.steps == 6
    assert all(f.dtype is torch.float32 for f in running_factors(optimizer).values())
    torch.testing.assert_close(running_factors(optimizer), running_factors(control), rtol=3e-2, atol=1e-3)
    torch.testing.assert_close(owned_params(optimizer), owned_params(control), rtol=2e-2, atol=2e-3)
    first_model, _ = fp32_control([])
    with torch.no_grad():
        control_losses = [F.cross_entropy(m(teacher_batch(k)[0]), teacher_batch(k)[1]).item()
                          for m, k in ((first_model, 0), (control_model, 6))]
    x, y = teacher_batch(6)
    losses.append(F.cross_entropy(model(x), y).item())
    torch.testing.assert_close([losses[0], losses[6]], control_losses, rtol=2e-2, atol=0)


def test_o2_preconditions_the_fp32_master_gradients(fake_apex: ModuleType) -> None:
    model, optimizer = apex_setup(fake_apex, "O2")
    for step in range(3):
        scaled_step(fake_apex, model, optimizer, *teacher_batch(step))
    stash = optimizer._amp_stash
    for block in optimizer.blocks:
        assert block.weight.dtype is torch.float32 and block.module.weight.dtype is torch.float16
        assert any(block.weight is m for m in stash.all_fp32_from_fp16_params)
        torch.testing.assert_close(block.module.weight, block.weight.half(), rtol=0, atol=0)
    # The same steps in fp32 with K-FAC, and with the same settings but no preconditioning (SGD):
    # Apex O2 must land next to the former, far from the latter.
    _, control = fp32_control([0, 1, 2])
    sgd_model = make_apex_mlp()
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=OPTIONS["lr"], momentum=0.9, weight_decay=1e-3)
    for step in range(3):
        x, y = teacher_batch(step)
        sgd.zero_grad()
        F.cross_entropy(sgd_model(x), y).backward()
        sgd.step()
    ours, kfac_ref, sgd_ref = (torch.cat([p.flatten() for p in ps]) for ps in (
        owned_params(optimizer), owned_params(control), [p.detach() for p in sgd_model.parameters()]))
    assert (ours - kfac_ref).norm() < 0.05 * (sgd_ref - kfac_ref).norm()


@pytest.mark.parametrize("opt_level", LEVELS)
def test_statistics_do_not_depend_on_apex_loss_scale(fake_apex: ModuleType, opt_level: str) -> None:
    results = []
    for scale in (2.0**8, 2.0**16):
        model, optimizer = apex_setup(fake_apex, opt_level)
        fake_apex._amp_state.loss_scalers[0]._loss_scale = scale
        for step in range(3):
            scaled_step(fake_apex, model, optimizer, *teacher_batch(step))
        results.append((running_factors(optimizer), owned_params(optimizer)))
        end_apex(fake_apex)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-8)


def test_the_scale_in_force_during_backward_is_used_when_apex_doubles_it_before_step(
    fake_apex: ModuleType,
) -> None:
    model, optimizer = apex_setup(fake_apex, "O2")
    scaler = fake_apex._amp_state.loss_scalers[0]
    scaled_step(fake_apex, model, optimizer, *teacher_batch(0))
    scaler._unskipped = scaler._scale_seq_len - 1  # the next scale_loss exit doubles the scale
    scaled_step(fake_apex, model, optimizer, *teacher_batch(1))
    assert scaler.loss_scale() == 2.0**17
    control_model, control = apex_setup(fake_apex, "O2")
    for step in range(2):
        scaled_step(fake_apex, control_model, control, *teacher_batch(step))
    torch.testing.assert_close(running_factors(optimizer), running_factors(control), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("opt_level", LEVELS)
def test_an_overflow_step_is_skipped_and_leaves_no_stale_statistics(fake_apex: ModuleType, opt_level: str) -> None:
    model, optimizer = apex_setup(fake_apex, opt_level)
    scaler = fake_apex._amp_state.loss_scalers[0]
    for step in range(2):
        scaled_step(fake_apex, model, optimizer, *teacher_batch(step))
    x, y = teacher_batch(99)
    x[0, 0] = float("inf")
    scaled_step(fake_apex, model, optimizer, x, y)  # Apex skips our step
    assert optimizer.steps == 2 and scaler.loss_scale() == 2.0**15
    assert all(block.pending_samples == 0 for block in optimizer.blocks)
    for step in range(2, 4):
        scaled_step(fake_apex, model, optimizer, *teacher_batch(step))
    end_apex(fake_apex)
    control_model, control = apex_setup(fake_apex, opt_level)
    for step in range(4):
        scaled_step(fake_apex, control_model, control, *teacher_batch(step))
    assert optimizer.steps == control.steps == 4
    torch.testing.assert_close(running_factors(optimizer), running_factors(control), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(owned_params(optimizer), owned_params(control), rtol=1e-5, atol=1e-7)


def test_o1_hook_math_runs_with_apex_casts_disabled(fake_apex: ModuleType) -> None:
    model, optimizer = apex_setup(fake_apex, "O1")
    block = optimizer.blocks[1]
    seen: list[tuple[bool, torch.dtype]] = []
    original = block.accumulate

    def spy(inputs: Tensor, grad_output: Tensor) -> None:
        seen.append((fake_apex._amp_state.handle.is_active(), grad_output.dtype))
        original(inputs, grad_output)

    block.accumulate = spy
    scaled_step(fake_apex, model, optimizer, *teacher_batch(0))
    assert seen == [(False, torch.float32)]
    assert fake_apex._amp_state.handle.is_active()


@pytest.mark.parametrize("opt_level", LEVELS)
def test_state_dict_round_trips_while_factors_are_empty_and_after_training(
    fake_apex: ModuleType, opt_level: str
) -> None:
    model, optimizer = apex_setup(fake_apex, opt_level)
    optimizer.load_state_dict(optimizer.state_dict())
    assert not any(bool(f.initialized) for b in optimizer.blocks for f in b.factors.values())
    for step in range(3):
        scaled_step(fake_apex, model, optimizer, *teacher_batch(step))
    before = running_factors(optimizer)
    before = {k: v.clone() for k, v in before.items()}
    optimizer.load_state_dict(optimizer.state_dict())
    torch.testing.assert_close(running_factors(optimizer), before, rtol=0, atol=0)
    scaled_step(fake_apex, model, optimizer, *teacher_batch(3))
    assert optimizer.steps == 4


def test_importing_and_using_kfac_never_needs_apex(fresh_kfac_interpreter: dict[str, object]) -> None:
    assert fresh_kfac_interpreter["steps"] == 1  # imported, built and stepped where `import apex` raises


@pytest.mark.parametrize("opt_level", LEVELS)
def test_sampled_fisher_statistics_are_left_unscaled_under_apex(fake_apex: ModuleType, opt_level: str) -> None:
    """The sampled pass runs outside ``scale_loss``: its statistics must not be divided by Apex's scale."""

    def train(model: nn.Module, optimizer: KFAC, under_apex: bool) -> None:
        for step in range(3):
            x, y = teacher_batch(step)
            optimizer.zero_grad()
            out = model(x)
            optimizer.sample_fisher(out, "cross_entropy", generator=torch.Generator().manual_seed(step))
            loss = F.cross_entropy(out.float(), y)
            if under_apex:
                with fake_apex.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            else:
                loss.backward()
            optimizer.step()

    model = make_apex_mlp()
    model, optimizer = fake_apex.initialize(model,
                                            KFAC(model, curvature=CurvatureConfig(fisher="sampled"),
                                                 **{"factor_update_steps": 1, "decomposition_update_steps": 10,
                                                    **OPTIONS}),
                                            opt_level=opt_level,
                                            verbosity=0)
    fake_apex._amp_state.loss_scalers[0]._loss_scale = 2.0**12
    train(model, optimizer, under_apex=True)
    end_apex(fake_apex)
    control_model = make_apex_mlp()
    control = KFAC(control_model, curvature=CurvatureConfig(fisher="sampled"),
                   **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    train(control_model, control, under_apex=False)
    torch.testing.assert_close(running_factors(optimizer), running_factors(control), rtol=3e-2, atol=1e-3)
    torch.testing.assert_close(owned_params(optimizer), owned_params(control), rtol=2e-2, atol=2e-3)
