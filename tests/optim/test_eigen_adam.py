"""``EigenAdam`` (method="eigen_adam"): Adam's second moment in K-FAC's eigenbasis (docs/design.md §3.x).

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
from distributed_helpers import spawn
from helpers import seeded_batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kfac_optim import KFAC, EigenAdam, RuntimeConfig

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
                               "factor_update_steps": 1, "inv_update_steps": 2}
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


def test_directions_equal_adam_in_the_factors_eigenbases_computed_densely() -> None:
    model = make_net()
    optimizer = make_optimizer(model)
    v: dict[str, torch.Tensor] = {}
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
            expected = u_g @ (rotated / (corrected.sqrt() + EPS)) @ u_a.T
            deltas = [(before[p] - p.detach().double()) / LR for p in block.parameters()]
            applied = block.joint_gradient(deltas[0], deltas[1] if len(deltas) > 1 else None)  # its layout
            where = f"{block.name} step {step}"
            torch.testing.assert_close(applied, expected, rtol=1e-3, atol=1e-3, msg=lambda m, where=where: f"{where}: {m}")
            torch.testing.assert_close(block.method_state["v"].double(), v[block.name], rtol=1e-4, atol=1e-10)
            assert block.method_state["t"].item() == step + 1
    assert bases_changed > 0  # the second moments were carried across refreshed bases, not reset


def test_checkpoint_resume_continues_bit_identically() -> None:
    model = make_net()
    optimizer = make_optimizer(model)
    for step in range(5):  # step 4 folded and decomposed: the resumed run rebuilds the same bases
        eigen_adam_step(model, optimizer, step)
    saved_model, saved_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert all("method_state" in state for state in saved_optimizer["kfac"]["blocks"].values())
    for step in range(5, 9):
        eigen_adam_step(model, optimizer, step)

    resumed = make_net(seed=1)
    resumed.load_state_dict(saved_model)
    resumed_optimizer = make_optimizer(resumed)
    resumed_optimizer.load_state_dict(saved_optimizer)
    for step in range(5, 9):
        eigen_adam_step(resumed, resumed_optimizer, step)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name
    for block, other in zip(optimizer.blocks, resumed_optimizer.blocks, strict=True):
        for key in ("v", "t"):
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
])
def test_bad_eigen_adam_settings_name_the_setting(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EigenAdam(**kwargs)


def test_describe_and_repr_name_the_method_and_its_settings() -> None:
    optimizer = KFAC(make_net(), lr=LR, method="eigen_adam", factor_update_steps=1, inv_update_steps=10)
    assert optimizer.describe().startswith("KFAC (eigen_adam)")
    assert repr(optimizer.method) == "EigenAdam(beta2=0.95, eps=1e-08)"


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
