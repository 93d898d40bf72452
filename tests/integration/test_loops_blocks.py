"""Training loops around which layers get which block, and what
``describe()`` / ``memory_usage()`` say: a frozen bias, subclasses that override ``forward``, a
construction-time lr of 0, ``eigen_adam``'s parameters outside K-FAC, frozen layers, coverage.

Every run here uses fixed intervals (the automatic ones depend on timings). References are control
runs (a bias-free layer, ``torch.optim.Adam``, a run whose factors were allocated eagerly, an
uninterrupted run) or dense formulas.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim import KFAC, CurvatureConfig, EigenAdam, UpdateConfig
from kfac_optim.layers import LinearBlock

FIXED: dict[str, Any] = {"factor_update_steps": 1, "decomposition_update_steps": 2}


def block_loop_batch(step: int, n: int = 8, features: int = 4, classes: int = 3) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, features, generator=generator), torch.randint(0, classes, (n,), generator=generator)


def train_steps(model: nn.Module, optimizer: KFAC, steps: range) -> None:
    for step in steps:
        x, y = block_loop_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def report_row(optimizer: KFAC, name: str) -> Any:
    (found,) = [r for r in optimizer.module_reports if r.name == name]
    return found


# -- 1. a frozen bias with a trainable weight ------------------------------------------------------


def mlp_with_first_bias(bias: bool) -> nn.Sequential:
    """``Linear(4, 8) → Tanh → Linear(8, 3)``, the first layer's bias frozen at 0 (``bias``) or absent."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():
        model[0].bias.zero_()  # frozen at 0: the same function as bias=False
    model[0].bias.requires_grad_(False)
    if bias:
        return model
    plain = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Tanh(), nn.Linear(8, 3))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if k != "0.bias"})
    return plain


def test_a_bias_frozen_before_construction_leaves_the_block_of_bias_false_bit_for_bit() -> None:
    """A layer whose bias is frozen (at 0) and a bias-free layer with the same weight compute the same
    function and gradients; with the block of ``bias=False`` (A without the trailing 1) their K-FAC
    runs are the same operations on the same numbers, so they agree bit for bit."""
    frozen, plain = mlp_with_first_bias(True), mlp_with_first_bias(False)
    assert torch.equal(frozen[0].weight, plain[0].weight)
    runs = []
    for model in (frozen, plain):
        optimizer = KFAC(model, lr=0.1, momentum=0.9, **FIXED)
        train_steps(model, optimizer, range(6))
        runs.append(optimizer)
    for name in ("0.weight", "2.weight", "2.bias"):
        assert torch.equal(dict(frozen.named_parameters())[name], dict(plain.named_parameters())[name]), name
    assert runs[0].blocks[0].A.dim == 4 and torch.equal(frozen[0].bias, torch.zeros(8))
    assert "bias was frozen when KFAC was built" in report_row(runs[0], "0").detail, runs[0].describe()


def test_a_bias_unfrozen_later_takes_the_sgd_path_warned_once_and_described() -> None:
    model = mlp_with_first_bias(True)
    optimizer = KFAC(model, lr=0.1, **FIXED)
    train_steps(model, optimizer, range(2))
    model[0].bias.requires_grad_(True)
    with pytest.warns(UserWarning, match=r"layer '0': its bias, frozen when KFAC was built .* takes the SGD path"):
        train_steps(model, optimizer, range(2, 4))
    before = model[0].bias.detach().clone()
    x, y = block_loop_batch(4)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grad = model[0].bias.grad.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        optimizer.step()
    torch.testing.assert_close(model[0].bias.detach(), before.add(grad, alpha=-0.1), rtol=0, atol=0)  # SGD's
    assert "bias take the SGD path" in report_row(optimizer, "0").detail


def test_a_bias_frozen_after_construction_warns_that_the_joint_factors_stay() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = KFAC(model, lr=0.1, **FIXED)
    model[0].bias.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"layer '0': its bias was frozen after KFAC was built: the weight is still"):
        train_steps(model, optimizer, range(1))
    assert "the bias is frozen now" in report_row(optimizer, "0").detail


# -- 2. subclasses that override forward ----------------------------------------------------------


class MuReadout(nn.Linear):
    """muP's readout: ``Linear(x / width_mult)``."""

    def __init__(self, in_features: int, out_features: int, width_mult: float) -> None:
        super().__init__(in_features, out_features)
        self.width_mult = width_mult

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x / self.width_mult)


class PlainSubclass(nn.Linear):
    pass


class MuReadoutBlock(LinearBlock):
    """The block of ``MuReadout``: its weight multiplies ``x / width_mult``."""

    def layer_input(self, args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module | None = None) -> Any:
        return super().layer_input(args, kwargs, module) / self.module.width_mult


def test_a_subclass_overriding_forward_inherits_no_block_and_is_named_once_with_how_to_register() -> None:
    model = nn.Sequential(PlainSubclass(4, 8), nn.Tanh(), MuReadout(8, 3, width_mult=4.0))
    with pytest.warns(UserWarning,
                      match=r"MuReadout subclasses Linear but overrides forward.*register_block") as caught:
        optimizer = KFAC(model, lr=0.1, **FIXED)
    assert sum("MuReadout" in str(w.message) for w in caught) == 1
    assert [b.name for b in optimizer.blocks] == ["0"]  # the plain subclass keeps Linear's block
    assert report_row(optimizer, "2").block is None and "overrides forward" in report_row(optimizer, "2").detail
    # Registered (here for one optimizer): no warning, and A is the dense mean [x/w, 1][x/w, 1]ᵀ of the
    # input the weight multiplies.
    model = nn.Sequential(MuReadout(4, 3, width_mult=4.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        optimizer = KFAC(model, lr=0.1, curvature=CurvatureConfig(blocks={MuReadout: MuReadoutBlock}), **FIXED)
    x, y = block_loop_batch(0)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    rows = torch.cat([x / 4.0, torch.ones(len(x), 1)], dim=1).double()
    torch.testing.assert_close(optimizer.blocks[0].A.running.double(), rows.T @ rows / len(x), rtol=1e-6, atol=1e-7)


# -- 3. built at lr=0 ----------------------------------------------------------------------------


def test_an_lr_of_zero_at_construction_warns_and_the_clip_is_indeed_off() -> None:
    """The warning's reason, checked: built at lr 0 and warmed up by hand to 0.1, the run is the
    run without a KL clip, bit for bit (ν = 1 at every step). The clip at the base lr is
    ``trust_region="base_lr"``; the default (``"lr_squared"``) does not depend on it (below)."""
    runs = []
    base_lr = UpdateConfig(trust_region="base_lr")
    for kl_clip, lr in ((1e-3, 0.0), (None, 0.0)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        if kl_clip is not None:
            with pytest.warns(UserWarning, match=r"lr=0 .* never clips .* scheduler"):
                optimizer = KFAC(model, lr=lr, kl_clip=kl_clip, update=base_lr, **FIXED)
        else:
            optimizer = KFAC(model, lr=lr, kl_clip=kl_clip, update=base_lr, **FIXED)
        for group in optimizer.param_groups:
            group["lr"] = 0.1  # the hand-written warmup's peak
        train_steps(model, optimizer, range(3))
        runs.append(model)
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters(), strict=True):
        assert torch.equal(a, b), name
    # What it recommends, built at the peak lr with a scheduler's warmup: no warning.
    model = nn.Sequential(nn.Linear(4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        optimizer = KFAC(model, lr=0.1, **FIXED)
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


def test_under_the_default_trust_region_a_run_built_at_lr_zero_is_the_run_built_at_its_peak() -> None:
    """``"lr_squared"`` takes ν at lr 1, so a hand-written warmup from lr 0 clips as a run built at
    the peak lr does: no warning, and the same parameters bit for bit."""
    runs = []
    for built_at in (0.0, 0.1):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            optimizer = KFAC(model, lr=built_at, kl_clip=1e-3, **FIXED)
        for group in optimizer.param_groups:
            group["lr"] = 0.1
        train_steps(model, optimizer, range(3))
        runs.append(model)
    for (name, a), b in zip(runs[0].named_parameters(), runs[1].parameters(), strict=True):
        assert torch.equal(a, b), name


# -- 4. eigen_adam: the parameters outside K-FAC follow Adam ---------------------------------------


def layer_norm_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


EIGEN_ADAM: dict[str, Any] = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-2, "kl_clip": None,
                              "method": "eigen_adam", **FIXED}


@pytest.mark.parametrize("own_first_moment", [False, True])
def test_eigen_adam_moves_parameters_outside_kfac_as_torch_adam_does(own_first_moment: bool) -> None:
    """The LayerNorm's parameters against ``torch.optim.Adam(lr, betas=(0.9, 0.95), eps=1e-8,
    weight_decay)`` fed the same gradients; β₁ is the group's momentum, or ``EigenAdam(beta1=0.9)``'s
    with momentum 0 (the method keeps the first moment). Tight tolerance, not bit-identical: Adam computes
    ``p − (lr/(1−β₁ᵗ))·m / (sqrt(v)/sqrt(1−β₂ᵗ) + ε)`` and K-FAC ``p − lr·(m/(1−β₁ᵗ)) / (sqrt(v/(1−β₂ᵗ)) + ε)``
    (the same quantity, other rounding)."""
    model = layer_norm_mlp()
    norm = list(model[1].parameters())
    control = [p.detach().clone().requires_grad_(True) for p in norm]
    adam = torch.optim.Adam(control, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=1e-2)
    own = {"momentum": 0.0, "method": EigenAdam(beta1=0.9)} if own_first_moment else {}
    optimizer = KFAC(model, **{**EIGEN_ADAM, **own})
    for step in range(5):
        x, y = block_loop_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p, c in zip(norm, control, strict=True):
            c.grad = p.grad.clone()
        optimizer.step()
        adam.step()
        for p, c in zip(norm, control, strict=True):
            torch.testing.assert_close(p.detach(), c.detach(), rtol=1e-6, atol=1e-7)
    assert (norm[0] - 1).abs().max() > 0.03  # it trains: about lr per step
    beta1 = "0.9" if own_first_moment else "the group's momentum"
    assert f"torch.optim.Adam's update with betas=({beta1}, 0.95)" in optimizer.describe()


def test_eigen_adam_with_its_own_first_moment_refuses_sgd_momentum() -> None:
    with pytest.raises(ValueError, match="beta1=0.9.*momentum=0"):
        KFAC(layer_norm_mlp(), **{**EIGEN_ADAM, "method": EigenAdam(beta1=0.9)})


def test_eigen_adam_resume_is_bit_identical_with_the_adam_moments_saved() -> None:
    model = layer_norm_mlp()
    optimizer = KFAC(model, **EIGEN_ADAM)
    train_steps(model, optimizer, range(3))
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    norm_state = saved["state"][2]  # model[1].weight: the third parameter
    assert {"graft_exp_avg", "graft_exp_avg_sq", "step"} <= set(norm_state)
    resumed = layer_norm_mlp()
    resumed.load_state_dict(saved_model)
    resumed_optimizer = KFAC(resumed, **EIGEN_ADAM)
    resumed_optimizer.load_state_dict(saved)
    train_steps(model, optimizer, range(3, 6))
    train_steps(resumed, resumed_optimizer, range(3, 6))
    for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_eigen_adam_refuses_sparse_gradients_naming_the_module() -> None:
    model = nn.Sequential(nn.Embedding(5, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"method='eigen_adam' .* needs dense gradients: module '0' has sparse=True"):
        KFAC(model, **EIGEN_ADAM)


# -- 5. a frozen layer costs nothing until it first gets a gradient --------------------------------


def frozen_base_mlp(seed: int = 0) -> nn.Sequential:
    """A frozen 32-wide base layer between two trainable ones."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
    model[2].requires_grad_(False)
    return model


def test_a_frozen_layer_holds_no_factor_memory_and_taps_nothing() -> None:
    model = frozen_base_mlp()
    optimizer = KFAC(model, lr=0.1, **FIXED)
    # the same model, K-FAC given only its trainable parameters (no block for the frozen one)
    control = frozen_base_mlp()
    trainable_only = KFAC(control, lr=0.1, params=[p for p in control.parameters() if p.requires_grad], **FIXED)
    assert optimizer.memory_usage() == trainable_only.memory_usage()
    hooked = []
    model[2].register_forward_hook(lambda module, args, output: hooked.append(output._backward_hooks))
    train_steps(model, optimizer, range(3))
    assert hooked == [None] * 3  # no tensor hook on the frozen layer's output: its hook tapped nothing
    frozen_block = optimizer.blocks[1]
    assert not frozen_block.A.allocated and not frozen_block.G.allocated
    assert optimizer.memory_usage()["factors"] == trainable_only.memory_usage()["factors"]
    assert "not allocated yet" in report_row(optimizer, "2").detail and "frozen now" in optimizer.describe()


def frozen_then_unfrozen(allocate_eagerly: bool) -> tuple[nn.Module, KFAC]:
    model = frozen_base_mlp()
    optimizer = KFAC(model, lr=0.1, momentum=0.9, **FIXED)
    if allocate_eagerly:  # the control: the layer's factors allocated (zeros) as before, never read
        for factor in optimizer.blocks[1].factors.values():
            factor.allocate()
    train_steps(model, optimizer, range(3))
    model[2].requires_grad_(True)
    train_steps(model, optimizer, range(3, 7))
    return model, optimizer


def test_an_unfrozen_layer_trains_as_it_would_with_its_factors_allocated_from_the_start() -> None:
    lazy, lazy_optimizer = frozen_then_unfrozen(False)
    eager, _ = frozen_then_unfrozen(True)
    for (name, a), b in zip(lazy.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b), name
    block = lazy_optimizer.blocks[1]
    assert block.A.allocated and bool(block.A.initialized) and block.A.decomposition is not None
    assert not torch.equal(lazy[2].weight, frozen_base_mlp()[2].weight)  # it trained


def test_a_checkpoint_with_a_frozen_layer_round_trips_without_its_factors() -> None:
    model = frozen_base_mlp()
    optimizer = KFAC(model, lr=0.1, momentum=0.9, **FIXED)
    train_steps(model, optimizer, range(2))
    saved_model, saved = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    assert saved["kfac"]["blocks"]["2"]["factors"]["A"]["running"] is None
    resumed = frozen_base_mlp()
    resumed.load_state_dict(saved_model)
    resumed_optimizer = KFAC(resumed, lr=0.1, momentum=0.9, **FIXED)
    resumed_optimizer.load_state_dict(saved)
    assert resumed_optimizer.memory_usage() == optimizer.memory_usage()
    for net in (model, resumed):
        net[2].requires_grad_(True)
    train_steps(model, optimizer, range(2, 5))
    train_steps(resumed, resumed_optimizer, range(2, 5))
    for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name


# -- 6. coverage ---------------------------------------------------------------------------------


class GRUWithLinearHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0][:, -1])


def test_a_model_mostly_without_blocks_warns_once_naming_the_largest_and_how_to_register() -> None:
    with pytest.warns(UserWarning, match=r"preconditions 48/(\d+) .* under 50%.*'rnn' \(GRU.*register_block") as caught:
        KFAC(GRUWithLinearHead(), lr=0.1, **FIXED)
    assert sum("under 50%" in str(w.message) for w in caught) == 1


def test_a_model_mostly_with_blocks_does_not_warn_about_coverage() -> None:
    model = nn.Sequential(nn.Linear(4, 16), nn.Bilinear(16, 16, 1))  # Bilinear: 256 of 320 elements
    model2 = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 16), nn.Bilinear(16, 16, 1))
    with pytest.warns(UserWarning, match="under 50%"):
        KFAC(model, lr=0.1, **FIXED)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        KFAC(model2, lr=0.1, **FIXED)  # 1280 of 1536 preconditioned
    messages = [str(w.message) for w in record]
    assert not any("under 50%" in message for message in messages), messages
    # the Bilinear still gets the warning of a weight matrix over 1% of the elements on SGD's path
    assert [m.partition(" takes")[0] for m in messages] == [
        "'3.weight' (Bilinear, 256 elements, 15.8% of the trainable ones)"]


# -- 7. describe() true after every change ---------------------------------------------------------


class PositionEmbeddingLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(11, 8)
        self.position = nn.Embedding(5, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.token(x) + self.position(torch.arange(x.shape[1])))


def test_describe_counts_a_position_embedding_left_to_sgd_as_not_preconditioned() -> None:
    model = PositionEmbeddingLM()
    optimizer = KFAC(model, lr=0.1, **FIXED)
    x = torch.randint(0, 11, (3, 5))
    with pytest.warns(RuntimeWarning, match="takes the SGD path"):
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        optimizer.step()
    covered, total = 11 * 8 + 11 * 8, 11 * 8 + 5 * 8 + 11 * 8
    assert (f"2 blocks precondition {covered}/{total} weight-matrix elements ({covered / total:.1%})"
            in optimizer.describe())
    assert report_row(optimizer, "position").block is None


def test_describe_shows_a_replaced_head_added_to_the_param_groups_as_new_and_on_the_sgd_path() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = KFAC(model, lr=0.1, **FIXED)
    model[2] = nn.Linear(8, 5)
    optimizer.add_param_group({"params": list(model[2].parameters())})
    head = report_row(optimizer, "2")
    assert head.params == (("weight", (5, 8)), ("bias", (5,))) and head.block is None and head.status == "added"
    assert "build a new KFAC" in head.detail
    first = optimizer.describe().splitlines()[0]
    # layer 0's 32 of: 32, the new head's 40 and the old head's 24 (still in the groups, outside the model)
    assert "1 blocks precondition 32/96 weight-matrix elements" in first, first


def test_describe_says_what_bitfit_biases_get_and_they_get_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    for layer in (model[0], model[2]):
        layer.weight.requires_grad_(False)
    optimizer = KFAC(model, lr=0.1, **FIXED)
    assert ("weight is frozen now" in report_row(optimizer, "0").detail
            and "bias takes the SGD path" in report_row(optimizer, "0").detail)
    before = model[0].bias.detach().clone()
    x, y = block_loop_batch(0)
    F.cross_entropy(model(x), y).backward()
    grad = model[0].bias.grad.clone()
    optimizer.step()
    torch.testing.assert_close(model[0].bias.detach(), before.add(grad, alpha=-0.1), rtol=0, atol=0)  # SGD's, as said
    assert not any(factor.allocated for block in optimizer.blocks for factor in block.factors.values())  # no work
    assert "0/0 weight-matrix elements" in optimizer.describe().splitlines()[0]
