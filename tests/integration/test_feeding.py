"""Which backward passes and which samples feed the Kronecker factors.

One test per situation. Each compares ``KFAC`` in an ordinary
training loop with the same loop written the simple way (or with ``torch.optim.SGD`` where K-FAC
must not touch a parameter), through the public API only: factors are read from
``kfac_state_dict()``, what K-FAC does with a module from ``describe()`` / ``module_reports``.

The rule these tests pin down (docs/design.md §4 "Capture"): a block records the
output-gradients of the backward that accumulates its weight's ``.grad``, once per forward;
side passes (``torch.autograd.grad`` over parameters or inputs) and passes through frozen
modules never record, and several backwards of one forward add up like their summed loss.
"""

from __future__ import annotations

import copy
import itertools
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kfac_optim import KFAC, CurvatureConfig
from kfac_optim.layers import ModuleReport
from kfac_optim.layers.factor import unpack_running

OPTIONS: dict[str, Any] = {"lr": 0.1, "momentum": 0.9, "damping": 0.1, "kl_clip": None,
                           "curvature": CurvatureConfig(factor_decay=0.9), "decomposition_update_steps": 1}
STEPS = 3


def mlp(seed: int = 0, sizes: tuple[int, ...] = (4, 8, 3)) -> nn.Sequential:
    """Linear → tanh → ... → Linear, seeded."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(nn.Tanh())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def batch(step: int, n: int = 6, features: int = 4, classes: int = 3) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, features, generator=generator), torch.randint(0, classes, (n,), generator=generator)


def factors(optimizer: KFAC) -> dict[str, Tensor]:
    """Every block's running factors by ``"<module>.<A|G>"``, from the public checkpoint (unpacked)."""
    blocks = optimizer.kfac_state_dict()["blocks"]
    held = {block.name: block.factors for block in optimizer.blocks}
    return {
        f"{name}.{kind}": unpack_running(factor["running"], held[name][kind].dim, held[name][kind].groups,
                                         held[name][kind].diagonal)
        for name, block in blocks.items()
        for kind, factor in block["factors"].items()
    }


def assert_factors_equal(actual: dict[str, Tensor], expected: dict[str, Tensor], rtol: float = 0,
                         atol: float = 0) -> None:
    """The same factors, bit for bit by default."""
    assert actual.keys() == expected.keys()
    for key in sorted(expected, key=lambda key: (not key.endswith(".G"), key)):  # G first: where a wrong capture shows
        torch.testing.assert_close(actual[key], expected[key], rtol=rtol, atol=atol,
                                   msg=lambda m, key=key: f"{key}: {m}")


def assert_runs_equal(expected: tuple[dict[str, Tensor], nn.Module], actual: tuple[dict[str, Tensor], nn.Module],
                      rtol: float = 0, atol: float = 0) -> None:
    """Two runs' ``(factors, model)``: the same factors, then the same parameters (bit for bit by default)."""
    assert_factors_equal(actual[0], expected[0], rtol=rtol, atol=atol)
    assert_factors_equal(dict(actual[1].named_parameters()), dict(expected[1].named_parameters()), rtol=rtol, atol=atol)


def report(optimizer: KFAC, module_name: str) -> ModuleReport:
    rows = [row for row in optimizer.module_reports if row.name == module_name]
    assert len(rows) == 1, f"describe() has {len(rows)} rows for {module_name!r}:\n{optimizer.describe()}"
    return rows[0]


# --- side passes --------------------------------------------------------------------------------


def run_classifier(
    extra_pass: Callable[[nn.Module, Tensor, Tensor, Tensor], None] | None
) -> tuple[dict[str, Tensor], nn.Module]:
    """``STEPS`` plain K-FAC steps; ``extra_pass(model, x, y, loss)`` runs after the forward,
    before ``loss.backward()``."""
    model = mlp()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if extra_pass is not None:
            extra_pass(model, x, y, loss)
        loss.backward()
        optimizer.step()
    return factors(optimizer), model


def test_monitoring_grad_pass_before_backward_does_not_change_the_factors() -> None:
    def gradient_norm(model: nn.Module, x: Tensor, y: Tensor, loss: Tensor) -> None:
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        torch.stack([g.norm() for g in grads]).norm()

    assert_runs_equal(expected=run_classifier(None), actual=run_classifier(gradient_norm))


def test_adversarial_input_gradient_pass_in_train_mode_does_not_change_the_factors() -> None:
    def run(attack_in_eval_mode: bool) -> tuple[dict[str, Tensor], nn.Module]:
        model = mlp()
        optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
        for step in range(STEPS):
            x, y = batch(step)
            optimizer.zero_grad()
            model.train(not attack_in_eval_mode)  # the same function: no dropout or batch norm
            x = x.clone().requires_grad_(True)
            (input_grad,) = torch.autograd.grad(F.cross_entropy(model(x), y), x)  # FGSM
            x_adv = (x + 0.1 * input_grad.sign()).detach()
            model.train()
            F.cross_entropy(model(x_adv), y).backward()
            optimizer.step()
        return factors(optimizer), model

    assert_runs_equal(expected=run(attack_in_eval_mode=True), actual=run(attack_in_eval_mode=False))


def test_setting_grads_to_none_drops_the_statistics_of_the_discarded_gradient() -> None:
    """``p.grad = None`` after a backward (a gradient thrown away outside the optimizer) drops
    that backward's pending statistics, as ``KFAC.zero_grad()`` would."""

    def discarded_backward(model: nn.Module, x: Tensor, y: Tensor, loss: Tensor) -> None:
        F.cross_entropy(model(2 * x), y).backward()
        for param in model.parameters():
            param.grad = None

    assert_runs_equal(expected=run_classifier(None), actual=run_classifier(discarded_backward))


# --- GANs ---------------------------------------------------------------------------------------


def gan() -> tuple[nn.Module, nn.Module]:
    """Generator noise (N, 2) → (N, 4); discriminator (N, 4) → (N, 1)."""
    return mlp(1, (2, 6, 4)), mlp(2, (4, 5, 1))


def gan_batch(step: int, n: int = 6) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(200 + step)
    return torch.randn(n, 4, generator=generator), torch.randn(n, 2, generator=generator)


def test_generator_pass_through_a_frozen_discriminator_does_not_feed_its_factors() -> None:
    """CycleGAN's ``set_requires_grad(D, False)`` around the generator's loss; both optimizers
    zeroed at the top of the iteration, both stepped at the end. The reference runs the
    generator's pass with D in eval mode (the same function: no dropout or batch norm), which
    K-FAC never records, so the trajectories are identical whenever the frozen pass feeds nothing."""

    def run(generator_pass_in_eval_mode: bool) -> tuple[dict[str, Tensor], nn.Module]:
        net_g, net_d = gan()
        opt_g, opt_d = (KFAC(net_g, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS}),
                        KFAC(net_d, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS}))
        for step in range(STEPS):
            real, noise = gan_batch(step)
            opt_g.zero_grad()
            opt_d.zero_grad()
            fake = net_g(noise)
            net_d.requires_grad_(False)
            net_d.train(not generator_pass_in_eval_mode)
            F.softplus(-net_d(fake)).mean().backward()  # non-saturating generator loss
            net_d.train()
            net_d.requires_grad_(True)
            (F.softplus(-net_d(real)).mean() + F.softplus(net_d(fake.detach())).mean()).backward()
            opt_g.step()
            opt_d.step()
        return factors(opt_d), net_d

    assert_runs_equal(expected=run(generator_pass_in_eval_mode=True), actual=run(generator_pass_in_eval_mode=False))


def test_module_level_zero_grad_gives_the_same_factors_as_the_optimizers() -> None:
    """The DCGAN example's loop: ``netD.zero_grad()`` / ``netG.zero_grad()`` instead of the
    optimizers'. The generator's backward runs through D (not frozen) after D's step."""

    def run(zero: Callable[[nn.Module, KFAC], None]) -> tuple[dict[str, Tensor], nn.Module]:
        net_g, net_d = gan()
        opt_g, opt_d = (KFAC(net_g, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS}),
                        KFAC(net_d, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS}))
        for step in range(STEPS):
            real, noise = gan_batch(step)
            zero(net_d, opt_d)
            F.softplus(-net_d(real)).mean().backward()
            fake = net_g(noise)
            F.softplus(net_d(fake.detach())).mean().backward()
            opt_d.step()
            zero(net_g, opt_g)
            F.softplus(-net_d(fake)).mean().backward()
            opt_g.step()
        return factors(opt_d), net_d

    assert_runs_equal(expected=run(lambda module, optimizer: optimizer.zero_grad()),
                      actual=run(lambda module, optimizer: module.zero_grad()))


# --- several backwards of one forward -----------------------------------------------------------


class TwoHeads(nn.Module):
    """A shared trunk and two task heads: (N, 4) → ((N, 3), (N, 2))."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(4, 8)
        self.head_a = nn.Linear(8, 3)
        self.head_b = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.head_a(h), self.head_b(h)


def test_multi_task_losses_backpropagated_separately_equal_their_sum() -> None:
    def run(separately: bool) -> tuple[dict[str, Tensor], nn.Module]:
        model = TwoHeads()
        optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
        for step in range(STEPS):
            x, y = batch(step)
            optimizer.zero_grad()
            out_a, out_b = model(x)
            loss_a, loss_b = F.cross_entropy(out_a, y), F.mse_loss(out_b, x[:, :2])
            if separately:
                loss_a.backward(retain_graph=True)
                loss_b.backward()
            else:
                (loss_a + loss_b).backward()
            optimizer.step()
        return factors(optimizer), model

    assert_runs_equal(expected=run(separately=False), actual=run(separately=True), rtol=1e-6, atol=1e-6)


# --- trainability and parameters ----------------------------------------------------------------


def test_backbone_unfrozen_after_construction_trains_and_is_preconditioned() -> None:
    model = mlp(sizes=(4, 8, 8, 3))  # "0", "2": backbone; "4": head
    backbone = model[:3]
    backbone.requires_grad_(False)
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    for step in range(2):
        x, y = batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    backbone.requires_grad_(True)
    before = {name: p.detach().clone() for name, p in backbone.named_parameters()}
    for step in range(2, 5):
        x, y = batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    moved = [name for name, p in backbone.named_parameters() if not torch.equal(p, before[name])]
    assert moved == list(before), f"the unfrozen backbone did not move: only {moved} of {list(before)}"
    for name in ("0", "2"):
        assert report(optimizer, name).status == "kfac", optimizer.describe()
        factor = optimizer.kfac_state_dict()["blocks"][name]["factors"]["G"]["running"]
        assert factor.abs().sum() > 0, f"{name}'s G is still empty after 3 steps unfrozen"


def test_unfrozen_layer_starts_with_empty_factors_and_takes_the_dense_kfac_step() -> None:
    """While frozen the layer's block exists but is empty and describe() says it is frozen; the step
    after unfreezing is ``ΔW = −lr (G ⊗ A + λI)⁻¹ vec[∇W | ∇b]`` from that step's own factors
    (built here from the layer's input and output-gradient: ``A = (1/N) Σ [x 1][x 1]ᵀ``,
    ``G = N Σ g gᵀ`` for the mean loss; a dense Kronecker product; momentum 0, no KL clip)."""
    model = mlp(sizes=(4, 8, 3))
    model[0].requires_grad_(False)
    options = {**OPTIONS, "momentum": 0.0}
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **options})
    x, y = batch(0)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*produced no statistics")  # frozen: silent by design
        optimizer.step()
    assert "frozen now" in optimizer.describe().splitlines()[1], optimizer.describe()
    assert not optimizer.kfac_state_dict()["blocks"]["0"]["factors"]["G"]["initialized"]
    model[0].requires_grad_(True)
    before = torch.cat([model[0].weight.detach(), model[0].bias.detach()[:, None]], dim=1)
    x, y = batch(1)
    twin = copy.deepcopy(model)  # a copy's hooks are inert: the reference adds no statistics
    output = twin[0](x)
    (output_grad,) = torch.autograd.grad(F.cross_entropy(twin[1:](output), y), output)
    rows, n = torch.cat([x, torch.ones(len(x), 1)], dim=1).double(), len(x)
    a, g = rows.T @ rows / n, n * output_grad.double().T @ output_grad.double()
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grad = torch.cat([model[0].weight.grad, model[0].bias.grad[:, None]], dim=1).double()
    optimizer.step()
    after = torch.cat([model[0].weight.detach(), model[0].bias.detach()[:, None]], dim=1)
    assert optimizer.kfac_state_dict()["blocks"]["0"]["factors"]["G"]["initialized"]
    assert "frozen now" not in optimizer.describe()
    dense = torch.kron(g, a) + options["damping"] * torch.eye(a.shape[0] * g.shape[0], dtype=torch.float64)
    expected = before.double() - options["lr"] * torch.linalg.solve(dense, grad.flatten()).reshape(grad.shape)
    torch.testing.assert_close(after.double(), expected, rtol=1e-5, atol=1e-6)


def test_parameters_outside_the_model_take_the_sgd_path_and_are_listed() -> None:
    """A learnable loss temperature in ``params``: it follows SGD bit for bit (the reference:
    K-FAC on the model alone and ``torch.optim.SGD`` on the temperature)."""

    def run(together: bool) -> tuple[Tensor, KFAC]:
        model = mlp()
        temperature = nn.Parameter(torch.tensor(1.5))
        sgd_options = {"lr": OPTIONS["lr"], "momentum": OPTIONS["momentum"]}
        if together:
            optimizer = KFAC(model, params=[*model.parameters(), temperature],
                             **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
            others: list[torch.optim.Optimizer] = []
        else:
            optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
            others = [torch.optim.SGD([temperature], **sgd_options)]
        for step in range(STEPS):
            x, y = batch(step)
            optimizer.zero_grad()
            for other in others:
                other.zero_grad()
            F.cross_entropy(model(x) / temperature, y).backward()
            optimizer.step()
            for other in others:
                other.step()
        return temperature.detach(), optimizer

    expected, alone = run(together=False)
    actual, optimizer = run(together=True)
    assert torch.equal(actual, expected)
    assert len(optimizer.module_reports) == len(alone.module_reports) + 1, optimizer.describe()
    extra = [row for row in optimizer.module_reports if row.block is None
             and any(shape == () for _, shape in row.params)]
    assert len(extra) == 1, optimizer.describe()  # the temperature, on the SGD path


def test_complex_linear_takes_the_sgd_path_with_a_true_reason() -> None:
    def run(make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(4)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3, dtype=torch.cfloat))
        optimizer = make_optimizer(model)
        for step in range(STEPS):
            x, _ = batch(step)
            target = torch.randn(6, 3, dtype=torch.cfloat, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            out = model[2](model[1](model[0](x)).to(torch.cfloat))
            (out - target).abs().square().mean().backward()
            optimizer.step()
        return model, optimizer

    sgd_model, _ = run(lambda model: torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters()}],
        lr=OPTIONS["lr"], momentum=OPTIONS["momentum"]))
    kfac_model, optimizer = run(lambda model: KFAC(
        model, params=[{"params": model[0].parameters(), "lr": 0.0}, {"params": model[2].parameters()}],
        **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS}))
    assert_factors_equal(dict(kfac_model[2].named_parameters()), dict(sgd_model[2].named_parameters()))
    row = report(optimizer, "2")
    assert row.status != "kfac" and "complex" in row.detail.lower(), optimizer.describe()


def parametrized(kind: str) -> nn.Sequential:
    model = mlp(sizes=(4, 8, 3))
    if kind == "weight_norm":
        nn.utils.parametrizations.weight_norm(model[2])
    elif kind == "spectral_norm":
        nn.utils.parametrizations.spectral_norm(model[2])
    else:
        torch.nn.utils.prune.l1_unstructured(model[2], "weight", amount=0.5)
    return model


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "prune"])
def test_parametrized_linear_is_preconditioned_or_takes_the_sgd_path_with_a_true_reason(kind: str) -> None:
    """Either choice is accepted here: preconditioned (then this test gains a dense reference)
    or the SGD path. On the SGD path the reason names the
    parametrization and the layer's parameters follow ``torch.optim.SGD`` bit for bit."""
    def groups(net: nn.Module) -> list[dict[str, Any]]:  # layer 0 (K-FAC's) frozen by lr 0, as in the complex test
        return [{"params": net[0].parameters(), "lr": 0.0}, {"params": net[2].parameters()}]

    model = parametrized(kind)
    optimizer = KFAC(model, params=groups(model), **{"factor_update_steps": 1, "decomposition_update_steps": 10,
                                                     **OPTIONS})
    rows = [row for row in optimizer.module_reports if row.name == "2" or row.name.startswith("2.")]
    if any(row.status == "kfac" for row in rows):
        pytest.fail("preconditioned parametrized Linear: add the dense reference for it here")
    word = "prun" if kind == "prune" else "parametriz"
    assert rows and all(row.status != "unregistered" and word in row.detail.lower()
                        for row in rows), optimizer.describe()
    reference = parametrized(kind)
    sgd = torch.optim.SGD(groups(reference), lr=OPTIONS["lr"], momentum=OPTIONS["momentum"])
    for step in range(STEPS):
        x, y = batch(step)
        for net, opt in ((model, optimizer), (reference, sgd)):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
        sgd.step()
        optimizer.step()
    assert_factors_equal(dict(model[2].named_parameters()), dict(reference[2].named_parameters()))


# --- batch-free inputs --------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Token and learned position embeddings, one MLP, a head: tokens (N, T) → logits (N, T, V)."""

    def __init__(self, vocab: int = 11, context: int = 5, width: int = 6, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(context, width)
        self.mlp = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.token.weight

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.token(tokens) + self.position(torch.arange(tokens.shape[1]))
        return self.head(h + torch.tanh(self.mlp(h)))


def lm_batch(seed: int, n: int, context: int = 5, vocab: int = 11) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, context + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def test_position_embedding_statistics_do_not_depend_on_the_batch_size() -> None:
    """The trace of a layer's G (a per-sample Fisher) has the same expectation at any batch size;
    averaged over 8 batches each, B=8 and B=128 agree within 10% for the token embedding. The
    position embedding ``position(arange(T))`` must as well, or take the SGD path saying why."""

    def mean_traces(batch_size: int) -> dict[str, float]:
        sums: dict[str, float] = {}
        for seed in range(8):
            model = TinyLM()
            optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
            lm_loss(model, *lm_batch(seed, batch_size)).backward()
            optimizer.step()
            for key, factor in factors(optimizer).items():
                if key.endswith(".G"):
                    sums[key] = sums.get(key, 0.0) + factor.trace().item() / 8
        return sums

    probe_model = TinyLM()
    probe = KFAC(probe_model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    lm_loss(probe_model, *lm_batch(0, 8)).backward()  # whether an input has a batch dimension shows in a forward
    probe.step()
    row = report(probe, "position")
    if row.status != "kfac":
        assert "batch" in row.detail.lower(), probe.describe()
        return
    small, large = mean_traces(8), mean_traces(128)
    ratios = {key: large[key] / small[key] for key in small}
    assert abs(ratios["token.G"] - 1) < 0.1, ratios  # the yardstick itself
    assert abs(ratios["position.G"] - 1) < 0.1, (
        f"position's G changes {1 / ratios['position.G']:.1f}x between B=8 and B=128 "
        f"(token's: {1 / ratios['token.G']:.1f}x)"
    )


class LabelConditioned(nn.Module):
    """``head(tanh(x + label(y)))``: a class-label embedding called with 1-D indices ``(N,)``, one per sample."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.label = nn.Embedding(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        return self.head(torch.tanh(x + self.label(labels)))


def test_one_dimensional_indices_of_one_per_sample_are_a_batch_and_stay_kfac() -> None:
    """Labels ``(N,)`` are a batched use (N = the other layers' batch): preconditioned, no warning.
    Positions ``(T,)`` with a batch N != T: the SGD path, one warning, the reason in describe()."""
    model = LabelConditioned()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for step in range(2):
            optimizer.zero_grad()
            x, y = batch(step, features=4)
            model(x, y).square().mean().backward()
            optimizer.step()
    assert report(optimizer, "label").status == "kfac"
    assert bool(factors(optimizer)["label.G"].trace() > 0)

    lm = TinyLM()
    optimizer = KFAC(lm, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    with pytest.warns(RuntimeWarning,
                      match="'position' takes the SGD path: its indices have no batch dimension") as caught:
        for seed in range(2):
            optimizer.zero_grad()
            lm_loss(lm, *lm_batch(seed, 8)).backward()
            optimizer.step()
    assert sum("no batch dimension" in str(w.message) for w in caught) == 1
    assert report(optimizer, "position").block is None and "no batch dimension" in optimizer.describe()
    assert bool(factors(optimizer)["position.G"].abs().sum() == 0)  # never recorded
    assert bool(factors(optimizer)["token.G"].trace() > 0)


def test_positions_with_a_batch_as_long_as_the_sequence_are_ambiguous_and_warn() -> None:
    lm = TinyLM()
    optimizer = KFAC(lm, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    with pytest.warns(RuntimeWarning, match="'position' was called with 1-D indices of length 5, the batch size"):
        lm_loss(lm, *lm_batch(0, 5)).backward()
        optimizer.step()
    assert report(optimizer, "position").status == "kfac"


# --- torch.compile ------------------------------------------------------------------------------


def compile_run(backend: str | None, step_compiled: bool = True, steps: int = 12) -> tuple[dict[str, Tensor], KFAC]:
    """12 steps of a tiny MLP with ``decomposition_update_steps=5``: the train step compiled with ``backend``
    (None: eager), ``optimizer.step()`` inside the compiled function or (``step_compiled=False``)
    called after it."""
    model = mlp()
    optimizer = KFAC(model, **{"factor_update_steps": 1, **{**OPTIONS, "decomposition_update_steps": 5}})

    def forward_backward(x: Tensor, y: Tensor) -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def train_step(x: Tensor, y: Tensor) -> Tensor:
        loss = forward_backward(x, y)
        optimizer.step()
        return loss

    compiled = torch.compile(train_step if step_compiled else forward_backward, backend=backend)
    for step in range(steps):
        if backend is None:
            train_step(*batch(step))
        else:
            compiled(*batch(step))
            if not step_compiled:
                optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, optimizer


# KFAC.step is a compile boundary (torch.compiler.disable): Dynamo drops attribute writes on Optimizer
# subclasses, so a traced step would never advance the step counter.
# Inductor's kernels round the model's own gradients differently from eager (SGD's would differ alike),
# so under inductor the bit-for-bit reference is the same compiled model with the step called eagerly.
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_train_step_equals_eager_bit_for_bit(backend: str) -> None:
    torch._dynamo.reset()
    start = time.perf_counter()
    actual, compiled_optimizer = compile_run(backend)
    seconds = time.perf_counter() - start
    if backend == "eager":
        expected, reference = compile_run(None)
    else:
        torch._dynamo.reset()
        expected, reference = compile_run(backend, step_compiled=False)
        eager_params, _ = compile_run(None)
        assert_factors_equal(actual, eager_params, rtol=1e-4, atol=1e-5)
    assert compiled_optimizer.state_dict()["kfac"]["steps"] == reference.state_dict()["kfac"]["steps"] == 12
    assert_factors_equal(actual, expected)
    assert_factors_equal(factors(compiled_optimizer), factors(reference))
    assert seconds < 120, f"the compiled run took {seconds:.1f} s"


def test_compiled_train_step_adds_no_graph_for_the_kfac_step() -> None:
    """``step()`` and ``zero_grad()`` are compile boundaries: the train step compiles to as many graphs
    as the same step without an optimizer (the capture's hooks removed: their graphs are the
    fullgraph test's subject)."""
    x, y = batch(0)

    def graphs(with_kfac: bool) -> int:
        torch._dynamo.reset()
        model = mlp()
        optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10,
                                   **OPTIONS}) if with_kfac else None
        if optimizer is not None:
            optimizer.remove_hooks()

        def train_step(x: Tensor, y: Tensor) -> Tensor:
            if optimizer is not None:
                optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if optimizer is not None:
                optimizer.step()
            return loss

        return torch._dynamo.explain(train_step)(x, y).graph_count

    assert graphs(with_kfac=True) == graphs(with_kfac=False)


def test_fullgraph_compiled_model_with_kfac_armed_records_like_eager() -> None:
    torch._dynamo.reset()
    x, y = batch(0)
    plain = torch._dynamo.explain(mlp())(x)
    model = mlp()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    hooked = torch._dynamo.explain(model)(x)
    assert hooked.graph_count == plain.graph_count, (hooked.graph_count, plain.graph_count, hooked.break_reasons)
    optimizer.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    eager = mlp()
    eager_optimizer = KFAC(eager, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    for step in range(2):
        x, y = batch(step)
        for net, opt in ((compiled, optimizer), (eager, eager_optimizer)):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    assert_factors_equal(factors(optimizer), factors(eager_optimizer), rtol=1e-6, atol=1e-7)



def conv_net(seed: int = 0) -> nn.Sequential:
    """Conv2d (padded) → in-place ReLU → Conv2d (stride 2) → Linear, for ``(N, 2, 6, 6)`` images."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, stride=2),
                         nn.Flatten(), nn.Linear(16, 3))


def token_net(seed: int = 0) -> nn.Sequential:
    """Embedding (with a padding index) → Linear, for ``(N, 4)`` tokens."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(10, 6, padding_idx=0), nn.Flatten(), nn.Linear(24, 3))


COMPILED_MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Tensor]]] = {
    "mlp": (mlp, lambda step: batch(step)[0]),
    "conv": (conv_net, lambda step: torch.randn(6, 2, 6, 6, generator=torch.Generator().manual_seed(step))),
    "embedding": (token_net, lambda step: torch.randint(0, 10, (6, 4), generator=torch.Generator().manual_seed(step))),
}


# Bit for bit: AOT autograd's backward (aot_eager: ATen ops, no fusion) gives these models eager's
# output-gradients, and the statistics math runs eagerly on them (inductor's kernels would round differently).
@pytest.mark.parametrize("kind", sorted(COMPILED_MODELS))
def test_fullgraph_aot_compiled_models_follow_the_eager_rule(kind: str) -> None:
    """Linear, Conv2d and Embedding blocks under ``torch.compile(fullgraph=True)`` (AOT autograd):
    as many graphs as without K-FAC, and over 2 steps of 2 micro-batches (gradient accumulation),
    each preceded by a monitoring ``torch.autograd.grad`` pass, the factors of the eager loop
    without that pass."""
    make, inputs = COMPILED_MODELS[kind]
    torch._dynamo.reset()
    plain = torch._dynamo.explain(make())(inputs(0)).graph_count
    model = make()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    assert torch._dynamo.explain(model)(inputs(0)).graph_count == plain == 1
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    eager = make()
    eager_optimizer = KFAC(eager, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    for step in range(2):
        for net, opt in ((compiled, optimizer), (eager, eager_optimizer)):
            opt.zero_grad()
            for micro in range(2):
                x, y = inputs(10 * step + micro), batch(10 * step + micro)[1]
                loss = F.cross_entropy(net(x), y)
                if net is compiled:  # records nothing: the eager loop runs without it
                    torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
                loss.backward()
            opt.step()
    expected = factors(eager_optimizer)
    assert all(factor.abs().sum() > 0 for factor in expected.values())
    assert_factors_equal(factors(optimizer), expected)
    assert_factors_equal(dict(model.named_parameters()), dict(eager.named_parameters()))


class TwoHeads(nn.Module):
    """A shared trunk and two task heads (the multi-task loop of docs/guide.md "What feeds the factors")."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3), nn.Linear(8, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.a(h), self.b(h)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_multi_task_backwards_add_up_like_the_summed_loss(backend: str) -> None:
    """``loss_a.backward(retain_graph=True); loss_b.backward()`` through a compiled model gives the
    factors of the eager ``(loss_a + loss_b).backward()`` (1e-6: summed output-gradients)."""
    torch._dynamo.reset()
    model, reference = TwoHeads(), TwoHeads()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    reference_optimizer = KFAC(reference, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for step in range(2):
        x, y = batch(step)
        optimizer.zero_grad()
        out_a, out_b = compiled(x)
        F.cross_entropy(out_a, y).backward(retain_graph=True)
        out_b.square().mean().backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        out_a, out_b = reference(x)
        (F.cross_entropy(out_a, y) + out_b.square().mean()).backward()
        reference_optimizer.step()
    assert_factors_equal(factors(optimizer), factors(reference_optimizer), rtol=1e-6, atol=1e-7)


def test_a_model_compiled_and_run_before_kfac_existed_warns_that_nothing_was_recorded() -> None:
    """Dynamo does not guard on module hooks: graphs traced before ``KFAC(model)`` keep running
    without the capture. The factor step says so once (and ``torch._dynamo.reset()`` cures it)."""
    torch._dynamo.reset()
    model = mlp()
    compiled = torch.compile(model, backend="eager")
    x, y = batch(0)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):  # Dynamo's default
        F.cross_entropy(compiled(x), y).backward()
        optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
        optimizer.zero_grad()
        F.cross_entropy(compiled(x), y).backward()
        with pytest.warns(RuntimeWarning, match="recorded no statistics .* torch._dynamo.reset"):
            optimizer.step()
        torch._dynamo.reset()
        optimizer.zero_grad()
        F.cross_entropy(compiled(x), y).backward()
        optimizer.step()
    assert all(factor.abs().sum() > 0 for factor in factors(optimizer).values())


def test_torch_state_initialization_at_lr_0_warns_nothing_and_a_moving_step_still_does() -> None:
    """``torch.distributed.checkpoint``'s ``get_state_dict`` builds a fresh optimizer's state with one
    ``step()`` at lr 0 on gradients it sets to zero, with no backward: no statistics is no news then.
    The next factor step that moves and records nothing (gradients set without a backward) warns."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = mlp()
    optimizer = KFAC(model, **{**OPTIONS, "factor_update_steps": 1, "decomposition_update_steps": 10})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, optimizer_state = get_state_dict(model, optimizer)
    assert optimizer.steps == 1 and optimizer_state["state"]  # torch's step ran and built the state
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    with pytest.warns(RuntimeWarning, match="recorded no statistics"):
        optimizer.step()


def test_compiled_multihead_attention_keeps_its_tensor_hooks_and_warns_once() -> None:
    """``nn.MultiheadAttention``'s blocks capture through their own torch function mode, which
    Dynamo does not trace: compiled, they keep the tensor hooks (graph breaks), say so once, and
    record as in eager mode."""

    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.attention, self.head = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.attention(x, x, x, need_weights=False)[0].mean(1))

    torch._dynamo.reset()
    model, eager = Attend(), Attend()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    eager_optimizer = KFAC(eager, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    compiled = torch.compile(model, backend="eager")
    x, y = torch.randn(6, 5, 8, generator=torch.Generator().manual_seed(0)), batch(0)[1]
    with pytest.warns(UserWarning, match="'attention.in_proj' records through a tensor hook under torch.compile"):
        F.cross_entropy(compiled(x), y).backward()
    optimizer.step()
    F.cross_entropy(eager(x), y).backward()
    eager_optimizer.step()
    assert_factors_equal(factors(optimizer), factors(eager_optimizer))

# --- DDP: learned positions and a tied head -----------------------------------------------------

DDP_STEPS = 10
DDP_BATCH = 8
DDP_OPTIONS: dict[str, Any] = {"lr": 0.1, "momentum": 0.9, "damping": 0.1, "kl_clip": 1e-2,
                               "curvature": CurvatureConfig(factor_decay=0.9), "decomposition_update_steps": 2}


def train_lm(model: nn.Module, optimizer: KFAC, rank: int = 0, world: int = 1) -> dict[str, Tensor]:
    size = DDP_BATCH // world
    for step in range(DDP_STEPS):
        tokens, targets = lm_batch(300 + step, DDP_BATCH)
        optimizer.zero_grad()
        lm_loss(model, tokens[rank * size : (rank + 1) * size], targets[rank * size : (rank + 1) * size]).backward()
        optimizer.step()
    inner = model.module if isinstance(model, DDP) else model
    return {name: p.detach().clone() for name, p in inner.named_parameters()}


def scenario_tied_lm(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """The same training under DDP and under FSDP2 (``fully_shard`` on the root; one spawn for both)."""
    from torch.distributed.fsdp import fully_shard

    model = DDP(TinyLM(tied=True))
    ddp = train_lm(model, KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **DDP_OPTIONS}),
                   rank, world)
    sharded = fully_shard(TinyLM(tied=True))
    fsdp = train_lm(sharded,
                    KFAC(sharded, **{"factor_update_steps": 1, "decomposition_update_steps": 10,
                                     **DDP_OPTIONS}), rank, world)
    return {"ddp": ddp, "fsdp": {name: p.full_tensor() for name, p in fsdp.items()}}


def test_tied_lm_with_learned_positions_on_two_ddp_ranks_equals_one_process(tmp_path: Path) -> None:
    """DDP and FSDP2, 2 ranks each: the parameters after 10 steps equal one process's on the whole batch."""
    from tests.distributed_helpers import spawn

    model = TinyLM(tied=True)
    expected = train_lm(model, KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10,
                                              **DDP_OPTIONS}))
    ranks = spawn(scenario_tied_lm, 2, tmp_path, deadline_s=90)
    for result in ranks:
        assert_factors_equal(result["ddp"], expected, rtol=0, atol=1e-5)
        assert_factors_equal(result["fsdp"], expected, rtol=0, atol=1e-5)
