"""``UpdateConfig`` (docs/design.md §4.1): the trust region that follows the scheduled lr, decoupled
weight decay and grafting, each against a reference written out in the test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, CurvatureConfig, UpdateConfig

DOUBLE = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64, factor_decay=0.0)
BASE_LR = UpdateConfig(trust_region="base_lr")  # the rule whose base lr these tests pin (lr cancels while binding)
SKIP_2 = CurvatureConfig(factor_dtype=torch.float64, inv_dtype=torch.float64, skip_layers=("2",))


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _labelled_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(32, 5, generator=generator, dtype=torch.float64), torch.randint(0, 3, (32,), generator=generator)


def _backward(net: nn.Module, seed: int = 0) -> None:
    x, y = _labelled_batch(seed)
    F.cross_entropy(net(x), y).backward()

def _step_length_from(optimizer: KFAC, net: nn.Module, start: list[torch.Tensor]) -> float:
    """One step's length ``‖p_after − start‖`` from the parameters ``start``, which are then restored."""
    optimizer.zero_grad()
    _backward(net)
    optimizer.step()
    length = float((_flat(start) - _flat(_params(net))).norm())
    with torch.no_grad():
        for p, p0 in zip(net.parameters(), start, strict=True):
            p.copy_(p0)
    return length



def _params(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


# -- the trust region follows the scheduled lr --------------------------------------------------


def _kfac_direction_and_gradient(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K-FAC's unclipped direction V (lr 1, no clip) and ∇ at ``_net()`` on ``_labelled_batch()``, flattened."""
    net = _net()
    optimizer = KFAC(net, lr=1.0, kl_clip=None, curvature=DOUBLE, decomposition_update_steps=1, factor_update_steps=1)
    before = _params(net)
    _backward(net, seed)
    grad = _flat([p.grad.clone() for p in net.parameters()])
    optimizer.step()
    return _flat(before) - _flat(_params(net)), grad


class _WarmupByHand:
    """A warmup written in the training loop, as nanoGPT does: ``group["lr"] = peak·(t+1)/6`` before step t."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer, self.t, self.peak = optimizer, 0, [float(g["lr"]) for g in optimizer.param_groups]
        self.step()

    def step(self) -> None:
        self.t += 1
        for group, peak in zip(self.optimizer.param_groups, self.peak, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(peak * self.t / 6)
            else:
                group["lr"] = peak * self.t / 6


SCHEDULES: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "warmup": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.125, total_iters=6),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6, eta_min=0.0),
    "warmup by hand": _WarmupByHand,
}


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float lr", "tensor lr"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_while_the_kl_bound_binds_the_step_scales_with_the_scheduled_lr(schedule: str, tensor_lr: bool) -> None:
    """Each step starts from the same parameters and batch (so ∇ and V are the same): the step's
    length is ``lr_t·ν·‖V‖`` with ``ν = sqrt(kl_clip / (lr₀² ⟨V, ∇⟩)) < 1`` at the base lr ``lr₀``,
    so ``‖step_t‖ / ‖step_0‖ = lr_t / lr₀`` (the KL clip at the scheduled lr made it 1)."""
    base_lr, kl_clip = 0.5, 1e-4
    direction, grad = _kfac_direction_and_gradient()
    inner = float(direction @ grad)
    nu = (kl_clip / (base_lr**2 * inner)) ** 0.5
    assert nu < 0.2  # the bound binds at every lr_t >= 0.2·lr₀, i.e. every step checked below

    net = _net()
    start = [p.detach().clone() for p in net.parameters()]
    lr = torch.tensor(base_lr) if tensor_lr else base_lr
    optimizer = KFAC(net, lr=lr, kl_clip=kl_clip, curvature=DOUBLE, decomposition_update_steps=1, factor_update_steps=1,
                     update=UpdateConfig(trust_region="base_lr"))
    scheduler = SCHEDULES[schedule](optimizer)
    lengths, lrs = [], []
    for _ in range(6):
        lrs.append(float(optimizer.param_groups[0]["lr"]))
        lengths.append(_step_length_from(optimizer, net, start))
        scheduler.step()
    assert max(lrs) / min(lrs) > 2  # the schedule moved the lr
    for lr_t, length in zip(lrs, lengths, strict=True):
        assert (lr_t / base_lr) ** 2 * inner * base_lr**2 > kl_clip  # still binding at lr_t
        assert length == pytest.approx(lr_t * nu * float(direction.norm()), rel=1e-2)
        assert length / lengths[0] == pytest.approx(lr_t / lrs[0], rel=1e-2)


@pytest.mark.parametrize("kl_clip", [None, 1e-4], ids=["default kl_clip", "kl_clip 1e-4"])
def test_doubling_the_base_lr_doubles_the_clipped_step(kl_clip: float | None) -> None:
    """The ``"lr_squared"`` trust region (the previous default): ``ν = sqrt(kl_clip / ⟨V, ∇⟩) < 1`` does not
    depend on the lr, so while the clip binds the first step is ``lr·ν·V``: twice the lr, twice the
    step (under ``"base_lr"`` or ``"scheduled_lr"`` the lr cancels and the step stays the same)."""
    settings: dict[str, Any] = {} if kl_clip is None else {"kl_clip": kl_clip}
    direction, grad = _kfac_direction_and_gradient()
    bound = KFAC(_net(), **settings).options.kl_clip
    assert bound is not None
    nu = (bound / float(direction @ grad)) ** 0.5
    assert nu < 0.5  # the clip binds at both lrs
    steps = []
    for lr in (0.1, 0.2):
        net = _net()
        before = _params(net)
        optimizer = KFAC(net, lr=lr, curvature=DOUBLE, decomposition_update_steps=1, factor_update_steps=1,
                         update=UpdateConfig(trust_region="lr_squared"), **settings)
        _backward(net)
        optimizer.step()
        steps.append(_flat(before) - _flat(_params(net)))
    torch.testing.assert_close(steps[0], 0.1 * nu * direction, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(steps[1], 2 * steps[0], rtol=1e-9, atol=1e-14)


def test_the_scheduled_lr_trust_region_keeps_the_step_fixed_while_binding() -> None:
    """``UpdateConfig(trust_region="scheduled_lr")``: the rule of earlier releases, lr cancels."""
    net = _net()
    start = _params(net)
    optimizer = KFAC(net, lr=0.5, kl_clip=1e-4, curvature=DOUBLE, decomposition_update_steps=1,
                     update=UpdateConfig(trust_region="scheduled_lr"), factor_update_steps=1)
    lengths = []
    for lr in (0.5, 0.25):
        optimizer.param_groups[0]["lr"] = lr
        lengths.append(_step_length_from(optimizer, net, start))
    assert lengths[1] == pytest.approx(lengths[0], rel=1e-6)


def test_at_a_constant_lr_the_base_lr_trust_region_is_the_old_rule_bit_for_bit() -> None:
    runs = []
    for trust_region in ("base_lr", "scheduled_lr"):
        net = _net()
        optimizer = KFAC(net, lr=0.3, momentum=0.9, kl_clip=1e-3, decomposition_update_steps=2,
                         params=[{"params": net[0].parameters(), "lr": 0.1}, {"params": net[2].parameters()}],
                         update=UpdateConfig(trust_region=trust_region), factor_update_steps=1)
        for seed in range(4):
            optimizer.zero_grad()
            _backward(net, seed)
            optimizer.step()
        runs.append(_params(net))
    for new, old in zip(*runs, strict=True):
        assert torch.equal(new, old)


def test_the_base_lr_is_saved_with_the_param_groups_and_restored() -> None:
    """The base lr is the group's lr when built; a resumed optimizer keeps the saved one."""
    net = _net()
    optimizer = KFAC(net, lr=0.4, kl_clip=1e-4, curvature=DOUBLE, factor_update_steps=1,
                     decomposition_update_steps=10, update=BASE_LR)
    _backward(net)
    optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.1
    state = optimizer.state_dict()
    resumed = KFAC(_net(), lr=0.1, kl_clip=1e-4, curvature=DOUBLE, factor_update_steps=1,
                   decomposition_update_steps=10, update=BASE_LR)
    resumed.load_state_dict(state)
    assert resumed.param_groups[0]["kfac_base_lr"] == 0.4
    assert resumed.trust_region_lr(resumed.param_groups[0]) == 0.4


def test_the_base_lr_is_each_groups_lr_when_built_whatever_a_scheduler_does() -> None:
    net = _net()
    optimizer = KFAC(net, lr=0.4, params=[{"params": net[0].parameters(), "lr": 0.2}, {"params": net[2].parameters()}],
                     factor_update_steps=1, decomposition_update_steps=10, update=BASE_LR)
    torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.02, 0.04])
    assert [optimizer.trust_region_lr(group) for group in optimizer.param_groups] == [0.2, 0.4]


def test_a_state_dict_of_an_earlier_release_takes_the_schedulers_initial_lr() -> None:
    net = _net()
    optimizer = KFAC(net, lr=0.4, factor_update_steps=1, decomposition_update_steps=10, update=BASE_LR)
    torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    state = optimizer.state_dict()
    del state["param_groups"][0]["kfac_base_lr"]
    resumed = KFAC(_net(), lr=0.1, factor_update_steps=1, decomposition_update_steps=10, update=BASE_LR)
    resumed.load_state_dict(state)
    assert resumed.trust_region_lr(resumed.param_groups[0]) == 0.4


# -- decoupled weight decay ---------------------------------------------------------------------


def test_decoupled_decay_where_kfac_is_off_is_sgd_with_the_decay_written_out() -> None:
    """Layer "0" takes the SGD path: ``p ← p·(1 − lr·wd)``, then SGD with momentum and no decay."""
    lr, wd, momentum = 0.1, 0.05, 0.9
    net = _net()
    optimizer = KFAC(net, lr=lr, momentum=momentum, weight_decay=wd, curvature=CurvatureConfig(skip_layers=("0",)),
                     update=UpdateConfig(decoupled_weight_decay=True), factor_update_steps=1,
                     decomposition_update_steps=10)
    reference = [p.detach().clone() for p in net[0].parameters()]
    buffers: list[torch.Tensor | None] = [None, None]
    for seed in range(3):
        optimizer.zero_grad()
        _backward(net, seed)
        for i, p in enumerate(net[0].parameters()):
            buffers[i] = p.grad.clone() if buffers[i] is None else buffers[i] * momentum + p.grad
            reference[i] = reference[i] * (1 - lr * wd) - lr * buffers[i]
        optimizer.step()
        for p, expected in zip(net[0].parameters(), reference, strict=True):
            torch.testing.assert_close(p.detach(), expected, rtol=1e-12, atol=1e-14)


def test_decoupled_decay_enters_neither_the_direction_nor_the_clip() -> None:
    """With the KL clip binding: one step with decoupled decay = ``p·(1 − lr·wd)`` + the step without decay."""
    lr, wd = 0.5, 0.1
    steps, buffers = [], []
    for decay in (0.0, wd):
        net = _net()
        optimizer = KFAC(net, lr=lr, momentum=0.9, weight_decay=decay, kl_clip=1e-5, curvature=DOUBLE,
                         update=UpdateConfig(trust_region="base_lr", decoupled_weight_decay=True),
                         factor_update_steps=1, decomposition_update_steps=10)
        before = _params(net)
        _backward(net)
        optimizer.step()
        steps.append([p.detach() - b * (1 - lr * decay) for p, b in zip(net.parameters(), before, strict=True)])
        buffers.append([optimizer.state[p]["momentum_buffer"] for p in net.parameters()])
    for without, with_decay in zip(*steps, strict=True):
        torch.testing.assert_close(with_decay, without, rtol=1e-12, atol=1e-14)
    for without, with_decay in zip(*buffers, strict=True):
        assert torch.equal(with_decay, without)


# -- grafting -----------------------------------------------------------------------------------


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.reshape(-1) @ b.reshape(-1) / (a.norm() * b.norm()))


def test_sgd_grafting_has_kfacs_direction_and_the_gradients_norm_per_tensor() -> None:
    lr = 0.3
    twin = _net()
    unclipped = KFAC(twin, lr=1.0, kl_clip=None, curvature=DOUBLE, factor_update_steps=1, decomposition_update_steps=10)
    twin_before = _params(twin)
    _backward(twin)
    unclipped.step()
    directions = [b - p.detach() for b, p in zip(twin_before, twin.parameters(), strict=True)]

    net = _net()
    optimizer = KFAC(net, lr=lr, kl_clip=None, curvature=DOUBLE, update=UpdateConfig(grafting="sgd"),
                     factor_update_steps=1, decomposition_update_steps=10)
    before = _params(net)
    _backward(net)
    grads = [p.grad.clone() for p in net.parameters()]
    optimizer.step()
    for p, b, g, v in zip(net.parameters(), before, grads, directions, strict=True):
        step = (b - p.detach()) / lr
        assert float(step.norm()) == pytest.approx(float(g.norm()), rel=1e-10)
        assert _cosine(step, v) == pytest.approx(1.0, abs=1e-10)
        assert _cosine(v, g) < 0.999  # K-FAC's direction is not the gradient's


def _adam_steps(grads: list[torch.Tensor], betas: tuple[float, float], eps: float) -> list[torch.Tensor]:
    """Adam's bias-corrected ``m̂/(sqrt(v̂)+ε)`` after each gradient in ``grads``, written out."""
    m, v, out = torch.zeros_like(grads[0]), torch.zeros_like(grads[0]), []
    for t, g in enumerate(grads, start=1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        out.append((m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps))
    return out


def test_adam_grafting_has_adams_step_norm_per_tensor_and_is_adamw_where_kfac_is_off() -> None:
    lr, wd, betas, eps = 0.01, 0.1, (0.9, 0.95), 1e-8
    update = UpdateConfig(grafting="adam", decoupled_weight_decay=True, adam_betas=betas, adam_eps=eps)
    net = _net()
    optimizer = KFAC(net, lr=lr, weight_decay=wd, kl_clip=None, curvature=SKIP_2, update=update, factor_update_steps=1,
                     decomposition_update_steps=10)
    twin = _net()  # layer "2" under torch.optim.AdamW, fed the same gradients
    adamw = torch.optim.AdamW(twin[2].parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
    v_twin = _net()
    first_direction = KFAC(v_twin, lr=1.0, kl_clip=None, curvature=SKIP_2, factor_update_steps=1,
                           decomposition_update_steps=10)
    v_before = _params(v_twin[0])
    _backward(v_twin)
    first_direction.step()
    direction = [b - p.detach() for b, p in zip(v_before, v_twin[0].parameters(), strict=True)]

    grads: list[list[torch.Tensor]] = [[], []]
    for seed in range(3):
        optimizer.zero_grad()
        _backward(net, seed)
        for i, p in enumerate(net[0].parameters()):
            grads[i].append(p.grad.clone())
        for p, q in zip(net[2].parameters(), twin[2].parameters(), strict=True):
            q.grad = p.grad.clone()
        before = _params(net[0])
        optimizer.step()
        adamw.step()
        for p, q in zip(net[2].parameters(), twin[2].parameters(), strict=True):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-14)
        for i, (p, b) in enumerate(zip(net[0].parameters(), before, strict=True)):
            step = (b * (1 - lr * wd) - p.detach()) / lr
            adam = _adam_steps(grads[i], betas, eps)[-1]
            assert float(step.norm()) == pytest.approx(float(adam.norm()), rel=1e-9)
            if seed == 0:  # the averaged direction is (1 − β1)·V after one step
                assert _cosine(step, direction[i]) == pytest.approx(1.0, abs=1e-9)
                assert _cosine(step, adam) < 0.999


def test_adam_grafting_refuses_a_sparse_embedding_by_name() -> None:
    net = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="grafting='adam'.*module '0'"):  # before the layers are discovered
        KFAC(net, lr=0.01, kl_clip=None, update=UpdateConfig(grafting="adam"), factor_update_steps=1,
             decomposition_update_steps=10)
