"""With preconditioning off, KFAC is torch.optim.SGD bit for bit (docs/numerics.md)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, CurvatureConfig


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 10),
    )


def sgd_train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int,
              scheduler_factory: Callable | None = None) -> None:
    scheduler = scheduler_factory(optimizer) if scheduler_factory else None
    generator = torch.Generator().manual_seed(123)
    for _ in range(steps):
        x = torch.randn(8, 1, 6, 6, generator=generator)
        y = torch.randint(0, 10, (8,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if scheduler:
            scheduler.step()


def two_groups(model: nn.Module) -> list[dict]:
    return [
        {"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
        {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "lr": 0.03, "weight_decay": 0.0},
    ]


SGD_SETTINGS = [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.1, "momentum": 0.9, "dampening": 0.2, "weight_decay": 5e-4},
    {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
    {"lr": 0.05, "momentum": 0.8, "maximize": True},
    {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "foreach": True},
]


def assert_bit_identical(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs"


@pytest.mark.filterwarnings("ignore:model has no supported layer")
@pytest.mark.parametrize("settings", SGD_SETTINGS, ids=lambda s: ",".join(s))
def test_all_layers_skipped_equals_sgd(settings: dict) -> None:
    model = small_cnn()
    reference = copy.deepcopy(model)
    sgd_train(model, KFAC(model, curvature=CurvatureConfig(skip_layers=[".*"]),
                          **{"factor_update_steps": 1, "decomposition_update_steps": 10, **settings}), steps=6)
    sgd_train(reference, torch.optim.SGD(reference.parameters(), **settings), steps=6)
    assert_bit_identical(model, reference)


@pytest.mark.filterwarnings("ignore:model has no supported layer")
def test_two_param_groups_and_step_lr_equal_sgd() -> None:
    model = small_cnn()
    reference = copy.deepcopy(model)
    settings = {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}
    schedule = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # noqa: E731
    sgd_train(model,
              KFAC(model, params=two_groups(model), curvature=CurvatureConfig(skip_layers=[nn.Linear, nn.Conv2d]),
                   **{"factor_update_steps": 1, "decomposition_update_steps": 10, **settings}), 7, schedule)
    sgd_train(reference, torch.optim.SGD(two_groups(reference), **settings), 7, schedule)
    assert_bit_identical(model, reference)


def test_model_without_supported_layers_warns_and_equals_sgd() -> None:
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(36))
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="no supported layer"):
        optimizer = KFAC(model, lr=0.1, momentum=0.9, factor_update_steps=1, decomposition_update_steps=10)
    generator = torch.Generator().manual_seed(0)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(4):
        x = torch.randn(8, 1, 6, 6, generator=generator)
        for m, opt in ((model, optimizer), (reference, reference_optimizer)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    assert_bit_identical(model, reference)


def test_unsupported_layers_in_a_kfac_model_follow_the_sgd_rule() -> None:
    """A BatchNorm parameter's update is exactly SGD's given its gradient, next to K-FAC layers."""
    model = small_cnn()
    optimizer = KFAC(model, lr=0.1, momentum=0.9, weight_decay=1e-3, factor_update_steps=1,
                     decomposition_update_steps=10)
    bn = model[1]
    buffer = None
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(8, 1, 6, 6, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before, grad = bn.weight.detach().clone(), bn.weight.grad.clone()
        optimizer.step()
        # SGD's own arithmetic (torch.optim.sgd's order of operations: `add(…, alpha=…)` rounds once)
        d = grad.add(before, alpha=1e-3)
        buffer = d.clone() if buffer is None else buffer.mul(0.9).add(d)
        assert torch.equal(bn.weight.detach(), before.add(buffer, alpha=-0.1))


def test_lr_scheduler_drives_kfac() -> None:
    model = small_cnn()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    sgd_train(model, optimizer, steps=1)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.05
