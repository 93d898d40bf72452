"""``EigenAdam`` (method="eigen_adam"): Adam's second moment in K-FAC's eigenbasis (docs/numerics.md, "Eigen-Adam").

The reference is built here from first principles: the joint gradients ``[∇W | ∇b]`` read before
each step, the eigenbases of the running factors (checked to diagonalize them), and the update
``v ← β₂ v + (1 − β₂) R²``, ``V = U_G [R / (sqrt(v / (1 − β₂ᵗ)) + ε)] U_Aᵀ`` in float64.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import gram_schmidt_refresh, seeded_batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kfac_optim import KFAC, EigenAdam, RuntimeConfig
from tests.distributed_helpers import spawn

LR, BETA2, EPS = 0.01, 0.9, 1e-4
# ε well above float32 rounding of the rotated gradient: the head's G is singular (a softmax's
# output-gradients sum to 0), and along its null direction R is rounding noise that R / sqrt(v̂)
# would blow up to ±1 in float32 and float64 alike, differently.
STEPS = 6


class EmbedMLP(nn.Module):
    """An embedding (diagonal ``A``), a Linear with bias and a head: tokens ``(N, 3)`` -> logits ``(N, 4)``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 5)
        self.hidden = nn.Linear(15, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens).flatten(1))))


def make_net(seed: int = 0) -> EmbedMLP:
    torch.manual_seed(seed)
    return EmbedMLP()


def token_batch(step: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``(size, 3)`` in ``[0, 7)`` and labels in ``[0, 4)``, the same for the same step."""
    x, y = seeded_batch((size, 3), 4, seed=100 + step)
    return (x.abs() * 3).long().clamp(max=6), y


def make_optimizer(model: nn.Module, **kwargs: Any) -> KFAC:
    options: dict[str, Any] = {"lr": LR, "method": EigenAdam(beta2=BETA2, eps=EPS), "kl_clip": None,
                               "factor_update_steps": 1, "decomposition_update_steps": 2}
    return KFAC(model, **{**options, **kwargs})


def eigen_adam_step(model: nn.Module, optimizer: KFAC, step: int) -> None:
    x, y = token_batch(step)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def joint_gradients(optimizer: KFAC) -> dict[str, torch.Tensor]:
    return {block.name: block.grad_matrix().double().clone() for block in optimizer.blocks}


def basis(factor: Any) -> torch.Tensor:
    """The held eigenbasis of a factor (the identity for a diagonal one), checked to be an
    orthonormal eigenbasis of its running average."""
    if factor.diagonal:
        return torch.eye(factor.dim, dtype=torch.float64)
    q = factor.decomposition.Q.double()
    assert q.shape == (factor.dim, factor.dim)  # full, never thin
    torch.testing.assert_close(q.T @ q, torch.eye(factor.dim, dtype=torch.float64), rtol=0, atol=1e-5)
    return q


@pytest.mark.parametrize("beta1", [None, 0.8])
def test_directions_equal_adam_in_the_factors_eigenbases_computed_densely(beta1: float | None) -> None:
    """``beta1`` None: ``R / (sqrt(v̂) + ε)``; a number: SOAP's placement of the first moment, Adam's
    ``m̂`` of the gradient (in the parameters' coordinates) rotated with the bases held now,
    ``U_Gᵀ m̂ U_A / (sqrt(v̂) + ε)``."""
    model = make_net()
    optimizer = make_optimizer(model, method=EigenAdam(beta2=BETA2, eps=EPS, beta1=beta1))
    v: dict[str, torch.Tensor] = {}
    m: dict[str, torch.Tensor] = {}
    bases_changed = 0
    previous: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        x, y = token_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = {p: p.detach().double().clone() for p in model.parameters()}
        grads = joint_gradients(optimizer)
        optimizer.step()
        for block in optimizer.blocks:
            u_a, u_g = basis(block.A), basis(block.G)
            if step % 2 == 0 and not block.A.diagonal:  # decomposed at this step: of the running factor
                a = block.A.running.double()
                torch.testing.assert_close(u_a.T @ a @ u_a, torch.diag(block.A.decomposition.d.double()),
                                           rtol=0, atol=1e-5 * a.abs().max().item())
            if block.name in previous and not torch.equal(previous[block.name], u_g):
                bases_changed += 1
            previous[block.name] = u_g
            rotated = u_g.T @ grads[block.name] @ u_a
            v[block.name] = BETA2 * v.get(block.name, torch.zeros_like(rotated)) + (1 - BETA2) * rotated**2
            corrected = v[block.name] / (1 - BETA2 ** (step + 1))
            numerator = rotated
            if beta1 is not None:
                m[block.name] = (beta1 * m.get(block.name, torch.zeros_like(grads[block.name]))
                                 + (1 - beta1) * grads[block.name])
                numerator = u_g.T @ (m[block.name] / (1 - beta1 ** (step + 1))) @ u_a
            expected = u_g @ (numerator / (corrected.sqrt() + EPS)) @ u_a.T
            deltas = [(before[p] - p.detach().double()) / LR for p in block.parameters()]
            applied = block.joint_gradient(deltas[0], deltas[1] if len(deltas) > 1 else None)  # its layout
            where = f"{block.name} step {step}"
            torch.testing.assert_close(applied, expected, rtol=1e-3, atol=1e-3,
                                       msg=lambda m, where=where: f"{where}: {m}")
            torch.testing.assert_close(block.method_state["v"].double(), v[block.name], rtol=1e-4, atol=1e-10)
            assert block.method_state["t"].item() == step + 1
    assert bases_changed > 0  # the second moments were carried across refreshed bases, not reset


@pytest.mark.parametrize("beta1, refresh", [(None, "eigh"), (0.8, "eigh"), (None, "power"), (0.8, "power")])
def test_checkpoint_resume_continues_bit_identically(beta1: float | None, refresh: str) -> None:
    """``refresh="power"``: the resumed run's refreshes at steps 6 and 8 start from the checkpoint's basis."""
    method = {"method": EigenAdam(beta2=BETA2, eps=EPS, beta1=beta1, refresh=refresh)}
    model = make_net()
    optimizer = make_optimizer(model, **method)
    for step in range(5):  # step 4 folded and decomposed: the resumed run rebuilds the same bases
        eigen_adam_step(model, optimizer, step)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert all("method_state" in state for state in saved_optimizer["kfac"]["blocks"].values())
    for step in range(5, 9):
        eigen_adam_step(model, optimizer, step)

    resumed = make_net(seed=1)
    resumed.load_state_dict(saved_model)
    resumed_optimizer = make_optimizer(resumed, **method)
    resumed_optimizer.load_state_dict(saved_optimizer)
    for step in range(5, 9):
        eigen_adam_step(resumed, resumed_optimizer, step)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
    for block, other in zip(optimizer.blocks, resumed_optimizer.blocks, strict=True):
        for key in ("v", "t") if beta1 is None else ("v", "t", "m"):
            assert torch.equal(block.method_state[key], other.method_state[key]), (block.name, key)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_leaves_that_layers_second_moments_untouched(bad: float) -> None:
    model = make_net()
    optimizer = make_optimizer(model, kl_clip=1e-3)
    for step in range(3):
        eigen_adam_step(model, optimizer, step)
    held = {block.name: {k: t.clone() for k, t in block.method_state.items()} for block in optimizer.blocks}
    x, y = token_batch(3)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    model.hidden.weight.grad[0, 0] = bad
    optimizer.step()
    by_name = {block.name: block for block in optimizer.blocks}
    for key in ("v", "t"):
        assert torch.equal(by_name["hidden"].method_state[key], held["hidden"][key]), key
    assert by_name["embed"].method_state["t"].item() == 4  # the other layers went on
    assert not torch.equal(by_name["embed"].method_state["v"], held["embed"]["v"])
    with pytest.warns(RuntimeWarning, match="'hidden'.*non-finite gradient"):
        eigen_adam_step(model, optimizer, 4)  # the next decomposition step reports it
    assert torch.isfinite(by_name["hidden"].method_state["v"]).all()


@pytest.mark.parametrize("kwargs, match", [
    ({"beta2": 1.0}, "beta2"),
    ({"beta2": -0.1}, "beta2"),
    ({"eps": 0.0}, "eps"),
    ({"eps": float("inf")}, "eps"),
    ({"thin_width": 64}, "thin_width"),
    ({"beta1": 1.0}, "beta1"),
    ({"beta1": True}, "beta1"),
    ({"refresh": "qr"}, "refresh"),
])
def test_bad_eigen_adam_settings_name_the_setting(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EigenAdam(**kwargs)


def test_describe_and_repr_name_the_method_and_its_settings() -> None:
    optimizer = KFAC(make_net(), lr=LR, method="eigen_adam", factor_update_steps=1, decomposition_update_steps=10)
    assert optimizer.describe().startswith("KFAC (eigen_adam)")
    assert repr(optimizer.method) == ("EigenAdam(max_rank=128, beta2=0.95, eps=1e-08, thin_width=256, beta1=None, "
                                      "refresh='eigh')")


# -- the warm-started refresh (refresh="power") ------------------------------------------------------


def test_power_refresh_holds_one_gram_schmidt_step_from_the_last_basis_at_each_decomposition() -> None:
    """The first decomposition is ``eigh``'s; every later one is the dense reference's refresh of the
    basis held before it, on the running factor then (``helpers.gram_schmidt_refresh``)."""
    model = make_net()
    optimizer = make_optimizer(model, method=EigenAdam(beta2=BETA2, eps=EPS, beta1=0.9, refresh="power"),
                               momentum=0.0)
    dense = [(block.name, side, factor) for block in optimizer.blocks for side, factor in block.factors.items()
             if not factor.diagonal]
    refreshed = 0
    for step in range(STEPS):
        held = {(name, side): None if f.decomposition is None else f.decomposition.Q.double().clone()
                for name, side, f in dense}
        eigen_adam_step(model, optimizer, step)
        for name, side, factor in dense:
            if step % 2 or held[(name, side)] is None:
                continue
            expected, estimated = gram_schmidt_refresh(factor.running.double(), held[(name, side)],
                                                       factor.running.dtype)
            torch.testing.assert_close(factor.decomposition.Q.double(), expected, rtol=0, atol=1e-5,
                                       msg=lambda m, where=(name, side, step): f"{where}: {m}")
            torch.testing.assert_close(factor.decomposition.d.double(), estimated, rtol=1e-4, atol=1e-7)
            refreshed += 1
    assert refreshed == 2 * len(dense)  # steps 2 and 4, every dense factor


def test_two_runs_with_the_power_refresh_are_bit_identical() -> None:
    runs = []
    for _ in range(2):
        model = make_net()
        optimizer = make_optimizer(model, method=EigenAdam(beta2=BETA2, eps=EPS, beta1=0.9, refresh="power"),
                                   momentum=0.0, decomposition_update_steps=1)
        for step in range(STEPS):
            eigen_adam_step(model, optimizer, step)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(p, q) for p, q in zip(*runs, strict=True))


def test_a_discarded_batch_of_statistics_under_the_power_refresh_keeps_every_state_finite() -> None:
    model = make_net()
    optimizer = make_optimizer(model, method=EigenAdam(beta2=BETA2, eps=EPS, beta1=0.9, refresh="power"),
                               momentum=0.0, decomposition_update_steps=1)
    for step in range(3):
        eigen_adam_step(model, optimizer, step)
    hidden = next(block for block in optimizer.blocks if block.name == "hidden")
    x, y = token_batch(3)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    hidden.A.pending[0, 0] = float("nan")  # a corrupted batch of A statistics, at a decomposition step
    with pytest.warns(RuntimeWarning, match=r"'hidden'.*non-finite.*A statistics discarded"):
        optimizer.step()
        eigen_adam_step(model, optimizer, 4)
    for block in optimizer.blocks:
        for factor in block.factors.values():
            held = factor.decomposition
            assert all(torch.isfinite(t).all() for t in ([held] if factor.diagonal else [held.Q, held.d]))
        assert all(torch.isfinite(t).all() for t in block.method_state.values()), block.name
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_non_finite_factor_fails_its_power_refresh_and_keeps_the_last_basis() -> None:
    model = make_net()
    method = EigenAdam(beta2=BETA2, eps=EPS, refresh="power")
    optimizer = make_optimizer(model, method=method)
    for step in range(3):
        eigen_adam_step(model, optimizer, step)
    factor = next(block for block in optimizer.blocks if block.name == "hidden").A
    held = factor.decomposition
    held_q = held.Q.clone()
    factor.running[1, 2] = factor.running[2, 1] = float("nan")
    factor.version += 1  # a new factor to decompose
    assert not factor.decompose(method, 0.0, torch.float32)
    assert factor.decomposition is held and torch.equal(held.Q, held_q)


# -- the thin basis of wide factors ---------------------------------------------------------------

THIN_RANK = 4  # below the hidden layer's A (15 wide, 16 with its bias column) and G (6), and the head's A (7)


def thin_optimizer(model: nn.Module, max_rank: int | None = THIN_RANK, refresh: str = "eigh", **kwargs: Any) -> KFAC:
    thin_width = THIN_RANK if max_rank == THIN_RANK else EigenAdam().thin_width
    method = EigenAdam(beta2=BETA2, eps=EPS, max_rank=max_rank, thin_width=thin_width, refresh=refresh)
    return make_optimizer(model, method=method, **kwargs)


def thin_basis(factor: Any, decomposed: bool) -> torch.Tensor:
    """The held basis of a factor wider than the cap, checked to be THIN_RANK orthonormal columns;
    ``decomposed`` (at a decomposition step): also that they diagonalize its running average,
    holding its leading eigenvalues."""
    q = factor.decomposition.Q.double()
    assert q.shape == (factor.dim, THIN_RANK)
    torch.testing.assert_close(q.T @ q, torch.eye(THIN_RANK, dtype=torch.float64), rtol=0, atol=1e-5)
    if not decomposed:
        return q
    running = factor.running.double()
    torch.testing.assert_close(q.T @ running @ q, torch.diag(factor.decomposition.d.double()),
                               rtol=0, atol=1e-5 * running.abs().max().item())
    leading = torch.linalg.eigvalsh(running)[-THIN_RANK:]
    torch.testing.assert_close(factor.decomposition.d.double(), leading, rtol=1e-3, atol=1e-6)
    return q


def test_pairs_under_the_cap_are_unchanged_bit_for_bit() -> None:
    """The default thin basis (max_rank=128) leaves every pair of a small model as full bases do;
    a cap of 4 changes the layers it caps."""
    runs = {}
    for max_rank in (None, EigenAdam().max_rank, THIN_RANK):
        model = make_net()
        optimizer = thin_optimizer(model, max_rank)
        for step in range(STEPS):
            eigen_adam_step(model, optimizer, step)
        runs[max_rank] = dict(model.named_parameters())
    for name, p in runs[None].items():
        assert torch.equal(runs[EigenAdam().max_rank][name], p), name
    assert not torch.equal(runs[THIN_RANK]["hidden.weight"], runs[None]["hidden.weight"])


@pytest.mark.parametrize("beta1", [None, 0.8])
def test_capped_directions_equal_the_thin_formula_computed_densely(beta1: float | None) -> None:
    """``R = Q_Gᵀ ∇ Q_A`` in the thin bases, ``O = ∇ − Q_G R Q_Aᵀ``, each with its own second moment:
    ``V = Q_G [R / (sqrt(v̂) + ε)] Q_Aᵀ + O / (sqrt(ŵ) + ε)``, in float64; with ``beta1``, Adam's
    ``m̂`` of the gradient split the same way takes the place of ``R`` and ``O`` in the numerators."""
    model = make_net()
    optimizer = make_optimizer(model, method=EigenAdam(beta2=BETA2, eps=EPS, max_rank=THIN_RANK, thin_width=THIN_RANK,
                                                       beta1=beta1))
    v: dict[str, torch.Tensor] = {}
    w: dict[str, torch.Tensor] = {}
    m: dict[str, torch.Tensor] = {}
    checked = set()
    for step in range(STEPS):
        x, y = token_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = {p: p.detach().double().clone() for p in model.parameters()}
        grads = joint_gradients(optimizer)
        optimizer.step()
        for block in optimizer.blocks:
            if block.A.diagonal:  # the embedding: full bases (test_pairs_under_the_cap_are_unchanged_bit_for_bit)
                continue
            q_a = thin_basis(block.A, step % 2 == 0)
            q_g = thin_basis(block.G, step % 2 == 0) if block.G.dim > THIN_RANK else basis(block.G)
            grad = grads[block.name]
            rotated = q_g.T @ grad @ q_a
            outside = grad - q_g @ rotated @ q_a.T
            v[block.name] = BETA2 * v.get(block.name, torch.zeros_like(rotated)) + (1 - BETA2) * rotated**2
            w[block.name] = BETA2 * w.get(block.name, torch.zeros_like(grad)) + (1 - BETA2) * outside**2
            correction = 1 - BETA2 ** (step + 1)
            if beta1 is not None:
                m[block.name] = beta1 * m.get(block.name, torch.zeros_like(grad)) + (1 - beta1) * grad
                first = m[block.name] / (1 - beta1 ** (step + 1))
                rotated = q_g.T @ first @ q_a
                outside = first - q_g @ rotated @ q_a.T
            expected = (q_g @ (rotated / ((v[block.name] / correction).sqrt() + EPS)) @ q_a.T
                        + outside / ((w[block.name] / correction).sqrt() + EPS))
            deltas = [(before[p] - p.detach().double()) / LR for p in block.parameters()]
            applied = block.joint_gradient(deltas[0], deltas[1] if len(deltas) > 1 else None)
            where = f"{block.name} step {step}"
            torch.testing.assert_close(applied, expected, rtol=1e-3, atol=1e-3,
                                       msg=lambda m, where=where: f"{where}: {m}")
            torch.testing.assert_close(block.method_state["w"].double(), w[block.name], rtol=1e-4, atol=1e-10)
            assert block.method_state["v"].shape == rotated.shape
            checked.add(block.name)
    assert checked == {"hidden", "head"}


@pytest.mark.parametrize("refresh, decomposition_update_steps", [("eigh", 4), ("power", 2)])
def test_capped_state_resumes_bit_identically_from_a_checkpoint(refresh: str, decomposition_update_steps: int) -> None:
    """``"eigh"``: decomposed at steps 0 and 4, the resumed steps 5-7 use those bases; ``"power"``: the
    thin bases refreshed at steps 2, 4 and, in the resumed run, 6 from the checkpoint's."""
    model = make_net()
    optimizer = thin_optimizer(model, refresh=refresh, decomposition_update_steps=decomposition_update_steps)
    for step in range(5):
        eigen_adam_step(model, optimizer, step)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert {"v", "t", "w"} <= set(saved_optimizer["kfac"]["blocks"]["hidden"]["method_state"])
    for step in range(5, 8):
        eigen_adam_step(model, optimizer, step)

    resumed = make_net(seed=1)
    resumed.load_state_dict(saved_model)
    resumed_optimizer = thin_optimizer(resumed, refresh=refresh, decomposition_update_steps=decomposition_update_steps)
    resumed_optimizer.load_state_dict(saved_optimizer)
    for step in range(5, 8):
        eigen_adam_step(resumed, resumed_optimizer, step)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
    for block, other in zip(optimizer.blocks, resumed_optimizer.blocks, strict=True):
        assert block.method_state.keys() == other.method_state.keys(), block.name
        for key, value in block.method_state.items():
            assert torch.equal(value, other.method_state[key]), (block.name, key)


class CorrelatedRegression(nn.Module):
    """``(N, 24)`` inputs -> a 16-wide tanh layer -> ``(N, 8)``; both layers' A wider than THIN_RANK."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(24, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def correlated_regression_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with a spread of scales (a fixed mixing with singular values 10⁻¹-10¹) and a teacher's
    targets: the ill-conditioning a K-FAC basis addresses and Adam's diagonal does not."""
    mixing_generator = torch.Generator().manual_seed(7)
    left, _ = torch.linalg.qr(torch.randn(24, 24, generator=mixing_generator))
    mixing = left * torch.logspace(-1, 1, 24)
    teacher = torch.randn(24, 8, generator=mixing_generator)
    x = torch.randn(64, 24, generator=torch.Generator().manual_seed(200 + step)) @ mixing.T
    return x, torch.tanh(x @ teacher / 10)


def regression_loss_after(optimizer_for: Any, steps: int) -> tuple[float, float]:
    """``(initial, final)`` loss on a held-out batch of :class:`CorrelatedRegression` trained ``steps``
    steps by ``optimizer_for(model)`` from the same initialization."""
    torch.manual_seed(0)
    model = CorrelatedRegression()
    x_test, y_test = correlated_regression_batch(steps)
    with torch.no_grad():
        initial = F.mse_loss(model(x_test), y_test).item()
    optimizer = optimizer_for(model)
    for step in range(steps):
        x, y = correlated_regression_batch(step)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        return initial, F.mse_loss(model(x_test), y_test).item()


def eigen_adam_recipe(max_rank: int | None) -> Any:
    """docs/tuning.md's EigenAdam (Adam's first moment through SGD's momentum), at CONVERGENCE_LR."""
    return lambda model: KFAC(model, lr=CONVERGENCE_LR, momentum=0.9, dampening=0.9, kl_clip=None,
                              factor_update_steps=1, decomposition_update_steps=2,
                              method=EigenAdam(max_rank=max_rank, thin_width=max_rank or EigenAdam().thin_width))


CONVERGENCE_LR, CONVERGENCE_STEPS = 1e-2, 20


def test_a_thin_basis_trains_a_tiny_model_as_far_as_full_bases_do() -> None:
    initial, thin = regression_loss_after(eigen_adam_recipe(THIN_RANK), CONVERGENCE_STEPS)
    _, full = regression_loss_after(eigen_adam_recipe(None), CONVERGENCE_STEPS)
    assert thin < initial
    assert initial - thin >= 0.9 * (initial - full), (initial, thin, full)


@pytest.mark.xfail(strict=True, reason="EigenAdam, with full bases as with thin ones, lowers this loss less than "
                                       "AdamW in 20 steps at the same lr (an open question of its own)")
@pytest.mark.parametrize("max_rank", [THIN_RANK, None])
def test_eigen_adam_lowers_the_loss_at_least_as_much_as_adamw_at_the_same_lr(max_rank: int | None) -> None:
    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=CONVERGENCE_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    initial, eigen_adam = regression_loss_after(eigen_adam_recipe(max_rank), CONVERGENCE_STEPS)
    _, reference = regression_loss_after(adamw, CONVERGENCE_STEPS)
    assert initial - eigen_adam >= initial - reference, (initial, eigen_adam, reference)


@pytest.mark.parametrize("max_rank", [THIN_RANK, None])
def test_eigen_adam_with_soaps_first_moment_lowers_the_loss_at_least_as_much_as_adamw(max_rank: int | None) -> None:
    """The same race with the first moment where SOAP keeps it (``EigenAdam(beta1=0.9)``, momentum 0)."""
    def adamw(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=CONVERGENCE_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)

    def soap_placed(model: nn.Module) -> KFAC:
        method = EigenAdam(max_rank=max_rank, thin_width=max_rank or EigenAdam().thin_width, beta1=0.9)
        return KFAC(model, lr=CONVERGENCE_LR, momentum=0.0, kl_clip=None, factor_update_steps=1,
                    decomposition_update_steps=2,
                    method=method)

    initial, eigen_adam = regression_loss_after(soap_placed, CONVERGENCE_STEPS)
    _, reference = regression_loss_after(adamw, CONVERGENCE_STEPS)
    assert initial - eigen_adam >= initial - reference, (initial, eigen_adam, reference)


def test_describe_names_the_factors_held_thin() -> None:
    optimizer = thin_optimizer(make_net())
    line = next(line for line in optimizer.describe().splitlines() if "thin eigenbasis" in line)
    assert ("max_rank=4 above width 4" in line and "hidden.A (16)" in line and "hidden.G (6)" in line
            and "head.A (7)" in line)
    assert "embed" not in line and "head.G" not in line


# -- two gloo ranks ------------------------------------------------------------------------------

DEADLINE_S = 120.0


def ddp_eigen_adam_scenario(rank: int, world: int, directory: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(make_net())
    optimizer = make_optimizer(model)
    for step in range(STEPS):
        x, y = token_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x[rank::world]), y[rank::world]).backward()
        optimizer.step()
    results: dict[str, Any] = {"params": {n: p.detach().clone() for n, p in model.module.named_parameters()},
                               "v": {b.name: b.method_state["v"].clone() for b in optimizer.blocks}}
    try:
        make_optimizer(DDP(make_net()), runtime=RuntimeConfig(grad_worker_fraction="mem-opt"))
        results["mem-opt error"] = None
    except ValueError as error:
        results["mem-opt error"] = str(error)
    return results


def test_two_ranks_equal_one_process_and_other_fractions_are_refused(tmp_path: Path) -> None:
    ranks = spawn(ddp_eigen_adam_scenario, 2, tmp_path, deadline_s=DEADLINE_S)
    model = make_net()
    optimizer = make_optimizer(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(STEPS):
            eigen_adam_step(model, optimizer, step)
    for result in ranks:
        for name, p in model.named_parameters():
            torch.testing.assert_close(result["params"][name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)
        for block in optimizer.blocks:
            torch.testing.assert_close(result["v"][block.name], block.method_state["v"], rtol=1e-3, atol=1e-9)
        assert result["mem-opt error"] is not None
        assert "grad_worker_fraction" in result["mem-opt error"] and "EigenAdam" in result["mem-opt error"]
    for name in ranks[0]["params"]:  # the ranks agree bit for bit
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
