"""The default trust region, ``UpdateConfig(trust_region="sgd")`` (docs/design.md §4.1): K-FAC's
direction at the length of SGD's first-order decrease, its KL estimate bounded by ``kl_clip``. Each
property against a control run written out in the test: plain ``torch.optim.SGD``, K-FAC's unclipped
direction, or the same run with the loss scaled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, CurvatureConfig

EXACT = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64)
EVERY_STEP = {"factor_update_steps": 1, "decomposition_update_steps": 1}
SCALES = torch.tensor([4.0, 2.0, 1.0, 0.5, 0.25, 0.125])
"""Input feature scales of the regression: curvature spread over 1000x, SGD's lr set by the largest."""


def _sgdtr_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _sgdtr_batch(generator: torch.Generator, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch whose inputs have the feature scales ``SCALES``; the target is linear in them."""
    x = torch.randn(size, 6, generator=generator, dtype=torch.float64) * SCALES.double()
    return x, x.sum(dim=1, keepdim=True) / 4


def _sgdtr_train(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int,
                  loss_scale: float = 1.0) -> float:
    """``steps`` steps on fresh batches (drawn from ``seed``) of ``loss_scale``·MSE; the mean loss on held-out
    batches."""
    generator = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        x, y = _sgdtr_batch(generator)
        optimizer.zero_grad()
        (loss_scale * F.mse_loss(net(x), y, reduction="mean")).backward()
        optimizer.step()
    held_out = torch.Generator().manual_seed(99)
    with torch.no_grad():
        return sum(float(F.mse_loss(net(x), y)) for x, y in (_sgdtr_batch(held_out, 256) for _ in range(2))) / 2


def _sgdtr_first_change(lr: float, loss_scale: float = 1.0, **kwargs: object) -> torch.Tensor:
    """The parameter change of K-FAC's first step at ``lr`` on ``loss_scale``·MSE (from ``_sgdtr_net(0)``),
    flattened."""
    net = _sgdtr_net(0)
    before = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
    _sgdtr_train(net, KFAC(net, lr=lr, curvature=EXACT, **EVERY_STEP, **kwargs), 1, seed=0, loss_scale=loss_scale)
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]) - before


def _sgdtr_first_gradient_and_direction(loss_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """∇ of ``loss_scale``·MSE and K-FAC's unclipped direction ``V`` (lr 1, ``kl_clip=None``) at the
    first step, flattened."""
    grad_net = _sgdtr_net(0)
    x, y = _sgdtr_batch(torch.Generator().manual_seed(1000))
    (loss_scale * F.mse_loss(grad_net(x), y)).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in grad_net.parameters()])
    return grad, -_sgdtr_first_change(1.0, loss_scale, kl_clip=None)


@pytest.mark.parametrize(("loss_scale", "lr"), [(1.0, 0.001), (1.0, 0.003), (0.01, 0.1)])
def test_the_step_promises_sgds_first_order_decrease_in_kfacs_direction(loss_scale: float, lr: float) -> None:
    """Below the KL bound the step is ``lr·ν·V`` with ``⟨lr·ν·V, ∇⟩ = lr·‖∇‖²``, SGD's first-order
    decrease (every parameter here is K-FAC's), whether K-FAC's own step ``lr·V`` promises less
    (inputs up to 4: large curvature) or more (the loss scaled by 0.01: the damping dominates); its
    direction is K-FAC's ``V``, not the gradient, and twice the lr takes twice the step."""
    grad, direction = _sgdtr_first_gradient_and_direction(loss_scale)
    nu = grad.dot(grad) / direction.dot(grad)
    assert (nu > 1) == (loss_scale == 1.0)  # both sides of K-FAC's own step are taken
    assert (2 * lr * nu) ** 2 * direction.dot(grad) < KFAC(_sgdtr_net(0)).options.kl_clip  # not binding
    change = _sgdtr_first_change(lr, loss_scale)
    torch.testing.assert_close(change, -lr * nu * direction, rtol=1e-9, atol=1e-15)
    torch.testing.assert_close(-change.dot(grad), lr * grad.dot(grad), rtol=1e-10, atol=0)
    if loss_scale == 1.0:  # where the damping dominates V ≈ ∇/λ: SGD's step itself
        assert float(F.cosine_similarity(change, -grad, dim=0)) < 0.99  # K-FAC's direction, not SGD's
    torch.testing.assert_close(_sgdtr_first_change(2 * lr, loss_scale), 2 * change, rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("lr", [1e3, 1e5])
def test_a_mistyped_lr_takes_a_step_of_kl_estimate_kl_clip_whatever_the_lr(lr: float) -> None:
    """At a huge lr the KL bound binds: ``lr²ν²⟨V, ∇⟩ = kl_clip``, so the step is
    ``sqrt(kl_clip / ⟨V, ∇⟩)·V`` and does not grow with the lr."""
    kl_clip = KFAC(_sgdtr_net(0)).options.kl_clip
    grad, direction = _sgdtr_first_gradient_and_direction()
    expected = -(kl_clip / torch.dot(direction, grad)).sqrt() * direction
    torch.testing.assert_close(_sgdtr_first_change(lr), expected, rtol=1e-9, atol=1e-15)


def test_a_summed_loss_at_lr_over_n_takes_the_steps_of_the_mean_loss_at_lr() -> None:
    """``N``·loss with ``loss_reduction="sum"`` (the factors keep per-sample units) at ``lr/N``: the same
    parameters after 4 steps with momentum as the mean loss at ``lr``."""
    batch, lr = 32, 0.1
    mean_net, sum_net = _sgdtr_net(0), _sgdtr_net(0)
    _sgdtr_train(mean_net, KFAC(mean_net, lr=lr, momentum=0.9, curvature=EXACT, **EVERY_STEP), 4, seed=0)
    summed = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64, loss_reduction="sum")
    _sgdtr_train(sum_net, KFAC(sum_net, lr=lr / batch, momentum=0.9, curvature=summed, **EVERY_STEP), 4, seed=0,
                  loss_scale=batch)
    for p, q in zip(mean_net.parameters(), sum_net.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12)


def test_momentum_accumulates_the_scaled_directions() -> None:
    """ν is chosen on each step's own ``V`` and SGD's momentum then accumulates ``ν·V``: after the same
    first step, the second step with momentum μ is the momentum-free run's second step plus μ times
    the first step (control: the same run at momentum 0, whose first two steps see the same
    parameters and batches)."""
    lr, momentum = 0.003, 0.9
    runs = {}
    for mu in (0.0, momentum):
        net = _sgdtr_net(0)
        optimizer = KFAC(net, lr=lr, momentum=mu, curvature=EXACT, **EVERY_STEP)
        generator, params = torch.Generator().manual_seed(1000), [_sgdtr_flat(net)]
        for _ in range(2):
            x, y = _sgdtr_batch(generator)
            optimizer.zero_grad()
            F.mse_loss(net(x), y).backward()
            optimizer.step()
            params.append(_sgdtr_flat(net))
        runs[mu] = params
    plain, heavy = runs[0.0], runs[momentum]
    torch.testing.assert_close(heavy[1], plain[1], rtol=0, atol=0)  # the first step: no history yet
    first_step = plain[1] - plain[0]
    torch.testing.assert_close(heavy[2] - heavy[1], plain[2] - plain[1] + momentum * first_step,
                               rtol=1e-9, atol=1e-15)


def _sgdtr_flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])


def _sgdtr_classifier(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _sgdtr_classify(net: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> float:
    """``steps`` steps of cross-entropy on fresh batches (labels of a fixed linear teacher over inputs
    with the feature scales ``SCALES``, drawn from ``seed``); the loss on a held-out batch."""
    teacher = torch.randn(6, 3, generator=torch.Generator().manual_seed(7))

    def batch(generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(size, 6, generator=generator) * SCALES
        return x, (x @ teacher).argmax(dim=1)

    generator = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        x, y = batch(generator, 32)
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        x, y = batch(torch.Generator().manual_seed(99), 1024)
        return float(F.cross_entropy(net(x), y))


def test_the_drop_in_ends_no_higher_than_sgd_at_sgds_best_lr() -> None:
    """``KFAC(model, lr)`` against ``torch.optim.SGD(model.parameters(), lr)`` on a small classifier, at
    the lr of a 3-point grid where SGD ends lowest, 3 seeds, 15 steps: K-FAC's loss is no higher on any
    seed. (With momentum 0.9 the two tie within the seeds' spread: docs/tuning.md.)"""
    steps, seeds, momentum = 15, range(3), 0.0

    def sgd_loss(lr: float, seed: int) -> float:
        net = _sgdtr_classifier(seed)
        return _sgdtr_classify(net, torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum), steps, seed)

    lr = min([0.03, 0.1, 0.3], key=lambda lr: sum(sgd_loss(lr, seed) for seed in seeds))
    for seed in seeds:
        net = _sgdtr_classifier(seed)
        kfac = _sgdtr_classify(net, KFAC(net, lr=lr, momentum=momentum), steps, seed)
        assert kfac <= sgd_loss(lr, seed), (lr, seed)
