"""The sampled (true) Fisher: ``KFAC(curvature=CurvatureConfig(fisher="sampled"))`` and ``KFAC.sample_fisher``.

References from first principles: targets drawn by hand with the same generator, per-sample
output-gradients from autograd on each sample's own loss, the Fisher's closed forms for the
categorical (``diag(p) - p pᵀ``) and Gaussian (``(2/D)·I``) likelihoods.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded_batch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kfac_optim import KFAC, CurvatureConfig
from kfac_optim.fisher import sampled_loss

N, D_IN, HIDDEN, D_OUT = 6, 5, 7, 3


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pre_activation = self.fc1(x)
        self.hidden = torch.tanh(self.pre_activation)
        return self.fc2(self.hidden)


def make(dtype: torch.dtype = torch.float64, **options) -> tuple[TwoLayer, KFAC]:
    torch.manual_seed(0)
    model = TwoLayer().to(dtype)
    defaults = dict(lr=0.1, curvature=CurvatureConfig(fisher="sampled", factor_decay=0.0, factor_dtype=dtype,
                                                      inv_dtype=dtype), decomposition_update_steps=1)
    return model, KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **{**defaults, **options}})


def fisher_batch(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_batch((N, D_IN), D_OUT, seed=1, dtype=dtype)


def training_loss(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, likelihood: str) -> torch.Tensor:
    if likelihood == "cross_entropy":
        return F.cross_entropy(out, y)
    return F.mse_loss(out, torch.zeros_like(out) + x[:, :D_OUT])


def drawn_targets(out: torch.Tensor, likelihood: str, seed: int) -> torch.Tensor:
    """The draws ``sample_fisher`` makes with ``torch.Generator().manual_seed(seed)``, made by hand."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if likelihood == "cross_entropy":
            return torch.multinomial(torch.softmax(out, dim=1), 1, generator=generator).squeeze(1)
        noise = torch.randn(out.shape, generator=generator, dtype=out.dtype)
        return out + noise * (out.shape[1] / 2) ** 0.5


def per_sample_loss(out_row: torch.Tensor, target: torch.Tensor, likelihood: str) -> torch.Tensor:
    if likelihood == "cross_entropy":
        return -torch.log_softmax(out_row, dim=0)[target]
    return ((out_row - target) ** 2).mean()


@pytest.mark.parametrize("likelihood", ["cross_entropy", "mse"])
def test_sampled_factors_match_a_dense_reference(likelihood: str) -> None:
    model, optimizer = make()
    x, y = fisher_batch()
    out = model(x)
    optimizer.sample_fisher(out, likelihood, generator=torch.Generator().manual_seed(7))
    training_loss(out, x, y, likelihood).backward()
    optimizer.step()

    reference = TwoLayer().double()
    reference.load_state_dict(make()[0].state_dict())
    out = reference(x)
    targets = drawn_targets(out, likelihood, seed=7)
    layer_outputs = {"fc1": reference.pre_activation, "fc2": out}
    layer_inputs = {"fc1": x, "fc2": reference.hidden.detach()}
    for block in optimizer.blocks:
        rows = []
        for n in range(N):
            loss_n = per_sample_loss(out[n], targets[n], likelihood)
            (grad,) = torch.autograd.grad(loss_n, layer_outputs[block.name], retain_graph=True)
            rows.append(grad[n])
        g_hat = torch.stack(rows)
        expected_g = g_hat.T @ g_hat / N
        a = torch.cat([layer_inputs[block.name], torch.ones(N, 1, dtype=torch.float64)], dim=1)
        expected_a = a.T @ a / N
        torch.testing.assert_close(block.G.running, expected_g, rtol=1e-10, atol=1e-12, msg=block.name)
        torch.testing.assert_close(block.A.running, expected_a, rtol=1e-10, atol=1e-12, msg=block.name)


@pytest.mark.parametrize("likelihood", ["cross_entropy", "mse"])
def test_sampled_output_gradients_have_the_fisher_covariance(likelihood: str) -> None:
    draws = 400_000
    logits = torch.tensor([1.0, -0.5, 0.3, 2.0], dtype=torch.float64)
    outputs = logits.repeat(draws, 1).requires_grad_()
    loss = sampled_loss(outputs, likelihood, generator=torch.Generator().manual_seed(3))
    (g_hat,) = torch.autograd.grad(loss, outputs)  # sum over samples: row n is sample n's gradient
    g_hat = g_hat.double()
    if likelihood == "cross_entropy":
        p = torch.softmax(logits, dim=0)
        expected = torch.diag(p) - torch.outer(p, p)
    else:
        expected = torch.eye(4, dtype=torch.float64) * 2 / 4
    torch.testing.assert_close(g_hat.mean(0), torch.zeros(4, dtype=torch.float64), rtol=0, atol=5e-3)
    torch.testing.assert_close(g_hat.T @ g_hat / draws, expected, rtol=0, atol=5e-3)


def test_sample_fisher_leaves_gradients_alone() -> None:
    x, y = fisher_batch()
    model, optimizer = make()
    out = model(x)
    optimizer.sample_fisher(out, "cross_entropy")
    assert all(p.grad is None for p in model.parameters())
    F.cross_entropy(out, y).backward()
    with_sampling = [p.grad.clone() for p in model.parameters()]
    model, optimizer = make()
    F.cross_entropy(model(x), y).backward()
    for actual, expected in zip(with_sampling, (p.grad for p in model.parameters()), strict=True):
        assert torch.equal(actual, expected)


def test_sample_fisher_records_only_on_factor_steps_and_the_training_backward_never() -> None:
    x, y = fisher_batch()
    model, optimizer = make(factor_update_steps=2)
    for step in range(4):
        optimizer.zero_grad()
        out = model(x)
        optimizer.sample_fisher(out, "cross_entropy")
        recorded = [block.pending_samples for block in optimizer.blocks]
        assert recorded == ([N, N] if step % 2 == 0 else [0, 0]), step
        F.cross_entropy(out, y).backward()
        assert [block.pending_samples for block in optimizer.blocks] == recorded
        optimizer.step()


def test_loss_scaling_does_not_change_sampled_factors() -> None:
    """A real GradScaler scales the training loss only: factors and parameters match a run without it."""
    results = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=2.0**12)):
        model, optimizer = make(torch.float32, factor_update_steps=1)
        x, y = fisher_batch(torch.float32)
        for step in range(3):
            optimizer.zero_grad()
            out = model(x)
            optimizer.sample_fisher(out, "cross_entropy", generator=torch.Generator().manual_seed(step))
            loss = F.cross_entropy(out, y)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
        results.append(([b.G.running.clone() for b in optimizer.blocks],
                        [p.detach().clone() for p in model.parameters()]))
    (factors, params), (scaled_factors, scaled_params) = results
    for actual, expected in zip(scaled_factors + scaled_params, factors + params, strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)


def test_sampled_fisher_errors_name_the_argument() -> None:
    model = TwoLayer()
    with pytest.raises(ValueError, match="fisher"):
        KFAC(model, curvature=CurvatureConfig(fisher="true"), factor_update_steps=1, decomposition_update_steps=10)
    empirical = KFAC(model, factor_update_steps=1, decomposition_update_steps=10)
    with pytest.raises(RuntimeError, match="fisher='sampled'"):
        empirical.sample_fisher(model(torch.randn(2, D_IN)), "cross_entropy")
    empirical.remove_hooks()
    model, optimizer = make(torch.float32)
    x, _ = fisher_batch(torch.float32)
    with pytest.raises(ValueError, match="likelihood"):
        optimizer.sample_fisher(model(x), "poisson")
    with pytest.raises(ValueError, match=r"\(N, C\)"):
        optimizer.sample_fisher(model(x).unsqueeze(2), "cross_entropy")
    with pytest.raises(ValueError, match="outputs"):
        optimizer.sample_fisher(model(x).detach(), "mse")
    model, optimizer = make(torch.float32, factor_update_steps=2)
    F.cross_entropy(model(x), fisher_batch()[1]).backward()
    optimizer.step()  # the next step does not update factors: a bad argument is still an error
    with pytest.raises(ValueError, match="outputs"):
        optimizer.sample_fisher(model(x).detach(), "mse")
    with torch.no_grad():
        optimizer.sample_fisher(model(x), "mse")  # an evaluation loop: nothing to do


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_models_are_sampled_or_the_user_is_told(reentrant: bool) -> None:
    """Non-reentrant checkpointing works; the reentrant variant hides the layers: a warning, not silence."""
    model, optimizer = make()
    x, y = fisher_batch()
    out = checkpoint(model, x.requires_grad_(), use_reentrant=reentrant)
    if reentrant:
        with pytest.warns(RuntimeWarning, match="use_reentrant=False") as caught:
            optimizer.sample_fisher(out, "cross_entropy")
        assert caught[0].filename == __file__
        assert [block.pending_samples for block in optimizer.blocks] == [0, 0]
    else:
        optimizer.sample_fisher(out, "cross_entropy")
        assert [block.pending_samples for block in optimizer.blocks] == [N, N]


def test_sample_fisher_in_eval_mode_records_as_in_training_mode() -> None:
    """Eval mode records (RL loops train with dropout off); under no_grad nothing."""
    model, optimizer = make()
    model.eval()
    with torch.no_grad():
        optimizer.sample_fisher(model(fisher_batch()[0]), "mse")
    assert [block.pending_samples for block in optimizer.blocks] == [0, 0]
    optimizer.sample_fisher(model(fisher_batch()[0]), "mse")
    assert [block.pending_samples for block in optimizer.blocks] == [N, N]


# -- sequences: (B, T, V) logits ------------------------------------------------------------------

B, T = 3, 4


def sequence_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``(B, T, D_IN)`` and token targets ``(B, T)`` (float64)."""
    generator = torch.Generator().manual_seed(5)
    return (torch.randn(B, T, D_IN, generator=generator, dtype=torch.float64),
            torch.randint(0, D_OUT, (B, T), generator=generator))


def test_sampled_sequence_factors_match_the_per_sample_reference() -> None:
    """``(B, T, V)`` logits: G is ``(1/B) Σ_b Σ_t ĝ_bt ĝ_btᵀ`` with ``ĝ_bt`` the gradient, at sample b's
    layer output at position t, of sample b's own loss, the mean over its T tokens at the drawn targets."""
    model, optimizer = make()
    x, y = sequence_batch()
    out = model(x)
    assert out.shape == (B, T, D_OUT)
    optimizer.sample_fisher(out, "cross_entropy", generator=torch.Generator().manual_seed(7))
    F.cross_entropy(out.reshape(-1, D_OUT), y.reshape(-1)).backward()
    optimizer.step()

    reference = TwoLayer().double()
    reference.load_state_dict(make()[0].state_dict())
    out = reference(x)
    generator = torch.Generator().manual_seed(7)  # one draw per token, row-major
    with torch.no_grad():
        targets = torch.stack([
            torch.stack([torch.multinomial(torch.softmax(out[b, t], dim=0), 1, generator=generator)[0]
                         for t in range(T)])
            for b in range(B)
        ])
    layer_outputs = {"fc1": reference.pre_activation, "fc2": out}
    layer_inputs = {"fc1": x, "fc2": reference.hidden.detach()}
    for block in optimizer.blocks:
        expected_g = torch.zeros_like(block.G.running)
        for b in range(B):
            loss_b = sum(-torch.log_softmax(out[b, t], dim=0)[targets[b, t]] for t in range(T)) / T
            (grad,) = torch.autograd.grad(loss_b, layer_outputs[block.name], retain_graph=True)
            expected_g += grad[b].T @ grad[b]  # (T, out): sample b's rows
        expected_g /= B
        a = torch.cat([layer_inputs[block.name].reshape(B * T, -1), torch.ones(B * T, 1, dtype=torch.float64)], 1)
        torch.testing.assert_close(block.G.running, expected_g, rtol=1e-10, atol=1e-12, msg=block.name)
        torch.testing.assert_close(block.A.running, a.T @ a / (B * T), rtol=1e-10, atol=1e-12, msg=block.name)


def test_sampled_sequence_fisher_has_the_empirical_fisher_units() -> None:
    """At the same targets, sample_fisher on ``(B, T, V)`` gives the G of the empirical Fisher of the
    mean-over-tokens loss (not T² times it, as flattening the logits by hand would)."""
    x, _ = sequence_batch()
    model, sampled = make()
    out = model(x)
    sampled.sample_fisher(out, "cross_entropy", generator=torch.Generator().manual_seed(11))
    drawn = torch.Generator().manual_seed(11)
    with torch.no_grad():
        targets = torch.multinomial(torch.softmax(out.reshape(-1, D_OUT), 1), 1, generator=drawn).reshape(B, T)
    F.cross_entropy(out.reshape(-1, D_OUT), targets.reshape(-1)).backward()
    sampled.step()

    torch.manual_seed(0)
    model = TwoLayer().double()
    empirical = KFAC(model, lr=0.1,
                     curvature=CurvatureConfig(factor_decay=0.0, factor_dtype=torch.float64, inv_dtype=torch.float64),
                     factor_update_steps=1, decomposition_update_steps=10)
    F.cross_entropy(model(x).reshape(-1, D_OUT), targets.reshape(-1)).backward()
    empirical.step()
    for s, e in zip(sampled.blocks, empirical.blocks, strict=True):
        torch.testing.assert_close(s.G.running, e.G.running, rtol=1e-10, atol=1e-14, msg=s.name)
        torch.testing.assert_close(s.A.running, e.A.running, rtol=1e-10, atol=1e-14, msg=s.name)
