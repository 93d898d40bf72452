"""Conversions and parameter swaps mid-run: the factors keep following the model.

``model.double()``, ``model.half()`` then ``.float()`` and ``.to(device)`` keep the parameter
objects but give each a new ``AccumulateGrad`` node (autograd does so on a dtype or device change);
``load_state_dict`` under ``torch.__future__.set_swap_module_params_on_conversion(True)`` swaps
the tensors inside the same objects. The step after each must fold that step's statistics: A and
G are compared with dense ones from the step's layer inputs and per-sample output-gradients.
A parameter replaced by another object (``load_state_dict(assign=True)``) is not the optimizer's
any more: that is warned about, once, naming the layer.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, CurvatureConfig

BATCH = 8


def conversion_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def conversion_kfac(model: nn.Module) -> KFAC:
    """K-FAC folding every step with ``factor_decay=0`` (the running factors are the last step's), in float64."""
    curvature = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64, factor_decay=0.0)
    return KFAC(model, lr=0.1, damping=0.1, kl_clip=None, factor_update_steps=1, decomposition_update_steps=1,
                curvature=curvature)


def train_conversion_step(model: nn.Sequential, optimizer: KFAC, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def per_sample_factors(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The step's dense factors in float64 from first principles: ``A = (1/N) Σ_i [a_i 1][a_i 1]ᵀ`` over the
    layer inputs, ``G = (1/N) Σ_i ∇ℓ_i ∇ℓ_iᵀ`` over each sample's own loss gradient with respect to the layer
    output (``G = N Σ g gᵀ`` of the mean loss's output-gradients)."""
    with torch.no_grad():
        inputs = [x, torch.tanh(model[0](x))]
    outputs = [model[0](inputs[0]), model[2](inputs[1])]
    per_sample_losses = F.cross_entropy(model[2](torch.tanh(outputs[0])), y, reduction="none")
    first = torch.autograd.grad(per_sample_losses.sum(), outputs[0])[0]  # row i: ∇ℓ_i (ℓ_i reads row i only)
    second = torch.autograd.grad(F.cross_entropy(outputs[1], y, reduction="sum"), outputs[1])[0]
    factors = {}
    for name, a, g in (("0", inputs[0], first), ("2", inputs[1], second)):
        a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1).double()
        g = g.double()
        factors[f"{name}.A"], factors[f"{name}.G"] = a.T @ a / BATCH, g.T @ g / BATCH
    return factors


@contextmanager
def swapping_parameters_on_conversion() -> Iterator[None]:
    """``torch.__future__.set_swap_module_params_on_conversion(True)`` for the block (restored after)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def to_double(model: nn.Module) -> None:
    model.double()


def to_half_then_float(model: nn.Module) -> None:
    model.half()
    model.float()


def load_shifted_by_swapping(model: nn.Module) -> None:
    shifted = {name: value + 0.01 for name, value in model.state_dict().items()}
    with swapping_parameters_on_conversion():
        model.load_state_dict(shifted)


def to_double_by_swapping(model: nn.Module) -> None:
    with swapping_parameters_on_conversion():
        model.double()


CONVERSIONS: dict[str, Callable[[nn.Module], None]] = {
    "double()": to_double,
    "half() then float()": to_half_then_float,
    "load_state_dict, swapping": load_shifted_by_swapping,
    "double(), swapping": to_double_by_swapping,
}


@pytest.mark.parametrize("convert", CONVERSIONS.values(), ids=CONVERSIONS.keys())
def test_the_step_after_a_conversion_or_swap_folds_that_steps_statistics(
        convert: Callable[[nn.Module], None]) -> None:
    model = conversion_mlp()
    optimizer = conversion_kfac(model)
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    for _ in range(2):  # the capture has held each layer's gradient node since
        train_conversion_step(model, optimizer, x, y)
    convert(model)
    x = x.to(model[0].weight.dtype)
    expected = per_sample_factors(model, x, y)
    optimizer.discard_pending_statistics()  # nothing the reference's passes may have left
    train_conversion_step(model, optimizer, x, y)
    for block in optimizer.blocks:
        for name, factor in block.factors.items():
            torch.testing.assert_close(factor.running, expected[f"{block.name}.{name}"],
                                       msg=lambda m, key=f"{block.name}.{name}": f"{key}: {m}")


def test_a_parameter_replaced_by_another_object_is_warned_once_naming_the_layer() -> None:
    model = conversion_mlp()
    optimizer = conversion_kfac(model)
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    train_conversion_step(model, optimizer, x, y)
    model[2].load_state_dict({name: value.clone() for name, value in model[2].state_dict().items()}, assign=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            train_conversion_step(model, optimizer, x, y)
    replaced = [str(w.message) for w in caught if "no longer the parameter KFAC was built with" in str(w.message)]
    assert len(replaced) == 1 and replaced[0].startswith("K-FAC layer '2':"), replaced


def test_a_side_pass_after_a_weight_was_frozen_since_its_forward_records_nothing_and_runs() -> None:
    model = conversion_mlp()
    optimizer = conversion_kfac(model)
    x, y = torch.randn(BATCH, 5, requires_grad=True), torch.randint(0, 3, (BATCH,))
    loss = F.cross_entropy(model(x), y)
    model[2].weight.requires_grad_(False)
    (input_gradient,) = torch.autograd.grad(loss, x)  # not a pass that writes .grad: nothing recorded
    assert input_gradient.shape == x.shape
    assert optimizer.estimator.capture.recorded == 0
