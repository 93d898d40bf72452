"""``damping=AdaptiveDamping(...)``: Levenberg–Marquardt damping (Martens & Grosse 2015 §6.5;
docs/design.md §4.2), against a reference computed here from first principles.

The reference model is a float64 two-layer MLP with factors of the current batch only
(``factor_decay=0``, factor and decomposition steps every step), so the Kronecker-factored
Fisher ``F̂ = blockdiag(G_l ⊗ A_l)`` is built densely from the layers' inputs and output-gradients,
the step is ``δ = −lr (F̂ + λI)⁻¹ ∇h`` and ``ρ = (h(θ+δ) − h(θ)) / (∇h·δ + ½ δᵀF̂δ)``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, AdaptiveDamping, CurvatureConfig, RuntimeConfig
from kfac_optim.update.damping import LevenbergMarquardt, damping_rule

BATCH = 16


def reduction_ratio_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def reduction_ratio_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, generator=generator, dtype=torch.float64)
    return x, torch.randn(BATCH, 2, generator=generator, dtype=torch.float64)


def reduction_ratio_optimizer(model: nn.Module, lr: float, damping: AdaptiveDamping | float, **kwargs: object) -> KFAC:
    return KFAC(model, lr=lr, damping=damping, kl_clip=None, factor_update_steps=1, decomposition_update_steps=1,
                curvature=CurvatureConfig(factor_decay=0.0, factor_dtype=torch.float64, inv_dtype=torch.float64),
                **kwargs)


def reduction_ratio_closure(model: nn.Module, optimizer: KFAC, x: torch.Tensor, y: torch.Tensor):
    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        if torch.is_grad_enabled():
            loss.backward()
        return loss
    return closure


def joint_params(model: nn.Sequential) -> torch.Tensor:
    """``[vec(W₁ | b₁), vec(W₂ | b₂)]``, each joint weight row-major."""
    return torch.cat([torch.cat([m.weight, m.bias[:, None]], 1).reshape(-1) for m in (model[0], model[2])])


def dense_fisher_and_gradient(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(h, ∇h, F̂)`` at the model's parameters: ``F̂ = blockdiag(G_l ⊗ A_l)`` with
    ``A = (1/N) Σ a aᵀ`` (inputs with a trailing 1) and ``G = (1/N) Σ ĝ ĝᵀ``, ``ĝ = N ∂h/∂s``."""
    first, second = model[0], model[2]
    s1 = first(x)
    s2 = second(torch.tanh(s1))
    loss = F.mse_loss(s2, y)
    params = [first.weight, first.bias, second.weight, second.bias]
    grads = torch.autograd.grad(loss, [s1, s2, *params])
    ones = torch.ones(BATCH, 1, dtype=x.dtype)
    blocks = []
    for inputs, output_grad in ((x, grads[0]), (torch.tanh(s1).detach(), grads[1])):
        a = torch.cat([inputs, ones], 1)
        g = BATCH * output_grad
        blocks.append(torch.kron(g.T @ g / BATCH, a.T @ a / BATCH))
    gw1, gb1, gw2, gb2 = grads[2:]
    gradient = torch.cat([torch.cat([gw1, gb1[:, None]], 1).reshape(-1), torch.cat([gw2, gb2[:, None]], 1).reshape(-1)])
    return loss.detach(), gradient, torch.block_diag(*blocks)


def test_rho_and_the_damping_trajectory_match_the_dense_reference() -> None:
    """Every step: the step uses λ_k, ρ is the dense model's, and λ follows the rule on the adaptation steps."""
    model, (x, y) = reduction_ratio_mlp(), reduction_ratio_batch()
    config = AdaptiveDamping(initial=0.01, every=2, omega=0.5)
    lr = 1.0
    optimizer = reduction_ratio_optimizer(model, lr, config)
    closure = reduction_ratio_closure(model, optimizer, x, y)
    damping, kinds = config.initial, set()
    for step in range(8):
        assert optimizer.damping_at(step) == pytest.approx(damping, rel=1e-12)
        loss, gradient, fisher = dense_fisher_and_gradient(model, x, y)
        before = joint_params(model).detach().clone()
        optimizer.step(closure)
        delta = joint_params(model).detach() - before
        expected = -lr * torch.linalg.solve(fisher + damping * torch.eye(len(gradient), dtype=fisher.dtype), gradient)
        torch.testing.assert_close(delta, expected, rtol=1e-6, atol=1e-9)
        if step % config.every:
            continue
        with torch.no_grad():
            after = F.mse_loss(model(x), y)
        rho = float((after - loss) / (gradient @ delta + 0.5 * delta @ fisher @ delta))
        assert optimizer.reduction_ratio == pytest.approx(rho, rel=1e-6)
        if rho > 0.75:
            damping, kind = damping * 0.5, "shrink"
        elif rho < 0.25:
            damping, kind = damping / 0.5, "grow"
        else:
            kind = "keep"
        kinds.add(kind)
    assert optimizer.damping_at(8) == pytest.approx(damping, rel=1e-12)
    assert kinds == {"shrink", "grow", "keep"}  # the trajectory exercises every branch


def test_the_rule_shrinks_above_three_quarters_and_grows_below_one_quarter() -> None:
    rule = LevenbergMarquardt(AdaptiveDamping(initial=1.0, omega=0.5, minimum=0.3, maximum=3.0))
    for rho, expected in ((0.9, 0.5), (0.76, 0.3), (0.5, 0.3), (0.75, 0.3), (0.1, 0.6), (-2.0, 1.2),
                          (math.nan, 2.4), (0.25, 2.4), (math.inf, 3.0), (0.9, 1.5), (-math.inf, 3.0), (0.0, 3.0)):
        rule.adapt(rho)
        assert rule.damping == pytest.approx(expected)
    assert AdaptiveDamping(every=4).factor == pytest.approx((19 / 20) ** 4)


@pytest.mark.parametrize("lr, shrinks", [(1e-3, True), (1.0, False)])
def test_a_small_step_shrinks_and_an_overshooting_one_grows_the_damping(lr: float, shrinks: bool) -> None:
    """A tiny step is predicted by the model (ρ ≈ 1 > 3/4); the full step at λ = 1e-3 raises the loss (ρ < 0)."""
    model, (x, y) = reduction_ratio_mlp(), reduction_ratio_batch()
    optimizer = reduction_ratio_optimizer(model, lr, AdaptiveDamping(initial=1e-3, every=1))
    optimizer.step(reduction_ratio_closure(model, optimizer, x, y))
    rho = optimizer.reduction_ratio
    assert (rho > 0.75) if shrinks else (rho < 0.25)
    assert (optimizer.damping_at(1) < 1e-3) if shrinks else (optimizer.damping_at(1) > 1e-3)


def test_state_dict_round_trip_resumes_the_damping_bit_exactly() -> None:
    model, (x, y) = reduction_ratio_mlp(), reduction_ratio_batch()
    optimizer = reduction_ratio_optimizer(model, 1.0, AdaptiveDamping(initial=0.05, every=1, omega=0.5))
    for _ in range(3):
        optimizer.step(reduction_ratio_closure(model, optimizer, x, y))
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert saved["kfac"]["damping"] == {"damping": optimizer.damping_at(3), "rho": optimizer.reduction_ratio}
    assert saved["kfac"]["damping"]["damping"] != 0.05

    resumed = reduction_ratio_mlp()
    resumed.load_state_dict(saved_model)
    again = reduction_ratio_optimizer(resumed, 1.0, AdaptiveDamping(initial=0.05, every=1, omega=0.5))
    again.load_state_dict(saved)
    assert (again.damping_at(3), again.reduction_ratio) == (optimizer.damping_at(3), optimizer.reduction_ratio)
    for _ in range(3):
        optimizer.step(reduction_ratio_closure(model, optimizer, x, y))
        again.step(reduction_ratio_closure(resumed, again, x, y))
    assert again.damping_at(6) == optimizer.damping_at(6)
    assert again.reduction_ratio == optimizer.reduction_ratio
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_bad_damping_state_in_a_checkpoint_is_refused_and_changes_nothing() -> None:
    model, (x, y) = reduction_ratio_mlp(), reduction_ratio_batch()
    optimizer = reduction_ratio_optimizer(model, 1.0, AdaptiveDamping(initial=0.05, every=1))
    optimizer.step(reduction_ratio_closure(model, optimizer, x, y))
    state = optimizer.state_dict()
    state["kfac"]["damping"] = {"damping": -1.0, "rho": 0.5}
    before = optimizer.damping_at(1)
    with pytest.raises(ValueError, match="'damping': 'damping' must be a finite number > 0"):
        optimizer.load_state_dict(state)
    assert optimizer.damping_at(1) == before


def test_damping_that_cannot_move_gives_the_constant_damping_run_bit_for_bit() -> None:
    """The measurement (snapshot, the closure's extra forward) leaves the update as it was."""
    runs = []
    for damping in (0.1, AdaptiveDamping(initial=0.1, every=1, minimum=0.1, maximum=0.1)):
        model, (x, y) = reduction_ratio_mlp(), reduction_ratio_batch()
        optimizer = reduction_ratio_optimizer(model, 0.5, damping, momentum=0.9, weight_decay=1e-3)
        for _ in range(4):
            optimizer.step(reduction_ratio_closure(model, optimizer, x, y))
        runs.append([p.detach().clone() for p in model.parameters()])
    assert optimizer.reduction_ratio is not None
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_constant_damping_has_no_reduction_ratio_and_saves_no_damping_state() -> None:
    model, (x, y) = reduction_ratio_mlp(), reduction_ratio_batch()
    optimizer = reduction_ratio_optimizer(model, 0.5, 0.1)
    optimizer.step(reduction_ratio_closure(model, optimizer, x, y))
    assert optimizer.reduction_ratio is None
    assert optimizer.state_dict()["kfac"]["damping"] is None


def test_without_a_closure_it_raises_naming_the_closure_before_any_change() -> None:
    model, (x, y) = reduction_ratio_mlp(), reduction_ratio_batch()
    optimizer = reduction_ratio_optimizer(model, 1.0, AdaptiveDamping())
    F.mse_loss(model(x), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"optimizer\.step\(closure\)"):
        optimizer.step()
    assert optimizer.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_closure_that_always_calls_backward_gets_a_message_saying_how_to_guard_it() -> None:
    model, (x, y) = reduction_ratio_mlp(), reduction_ratio_batch()
    optimizer = reduction_ratio_optimizer(model, 1.0, AdaptiveDamping(every=1))

    def unguarded() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="torch.is_grad_enabled"):
        optimizer.step(unguarded)


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "eigen_adam"}, "eigen_adam"),
    ({"curvature": CurvatureConfig(loss_reduction="sum")}, "loss_reduction='sum'"),
])
def test_settings_it_cannot_serve_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KFAC(reduction_ratio_mlp(), damping=AdaptiveDamping(), **kwargs)


def test_maximize_is_refused_at_the_first_step() -> None:
    model, (x, y) = reduction_ratio_mlp(), reduction_ratio_batch()
    optimizer = KFAC(model, damping=AdaptiveDamping(), maximize=True)
    with pytest.raises(ValueError, match="maximize"):
        optimizer.step(reduction_ratio_closure(model, optimizer, x, y))


@pytest.mark.parametrize("kwargs, message", [
    ({"initial": 0.0}, "initial"), ({"every": 0}, "every"), ({"every": 2.0}, "every"), ({"omega": 1.0}, "omega"),
    ({"omega": 0.0}, "omega"), ({"minimum": -1.0}, "minimum"), ({"maximum": math.inf}, "maximum"),
    ({"initial": 10.0, "maximum": 1.0}, "minimum <= initial <= maximum"),
])
def test_bad_settings_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdaptiveDamping(**kwargs)


def test_statistics_on_a_worker_thread_give_the_same_damping_and_parameters() -> None:
    """The model's curvature reads the factors after the worker's fold (``async_statistics``)."""
    runs = []
    for runtime in (None, RuntimeConfig(async_statistics=True)):
        model, (x, y) = reduction_ratio_mlp(), reduction_ratio_batch()
        optimizer = reduction_ratio_optimizer(model, 1.0, AdaptiveDamping(initial=0.01, every=1, omega=0.5),
                                              runtime=runtime)
        for _ in range(4):
            optimizer.step(reduction_ratio_closure(model, optimizer, x, y))
        runs.append((optimizer.damping_at(4), optimizer.reduction_ratio,
                     [p.detach().clone() for p in model.parameters()]))
    assert runs[0][:2] == runs[1][:2]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2], strict=True))


def test_several_ranks_are_refused_until_rho_is_summed_over_them() -> None:
    with pytest.raises(NotImplementedError, match="several ranks"):
        damping_rule(AdaptiveDamping(), distributed=True)
    assert damping_rule(0.1, distributed=True).at(0) == 0.1
