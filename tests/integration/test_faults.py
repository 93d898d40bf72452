"""KFAC inside the training loops people write: hook lifecycle, copies, faults, checkpoints.

Each test reproduces a situation of ordinary training code and states the behaviour K-FAC has in
it (docs/guide.md, "Failure modes").
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded_batch
from torch import nn

from kfac_optim import KFAC, CurvatureConfig


def faults_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def faults_batch(n: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_batch((n, 6), 3, seed=seed)


def faults_train_step(net: nn.Module, optimizer: KFAC, seed: int = 0) -> None:
    x, y = faults_batch(seed=seed)
    optimizer.zero_grad()
    F.cross_entropy(net(x), y).backward()
    optimizer.step()


def forward_hook_count(net: nn.Module) -> int:
    return sum(len(module._forward_hooks) for module in net.modules())


# -- capture lifecycle --------------------------------------------------------------------------


def test_gradient_penalty_records_plain_tensors_once_per_step() -> None:
    """A double backward records the output-gradients of the backward that produces ``.grad``."""
    torch.manual_seed(0)
    net = faults_mlp()
    reference_net = copy.deepcopy(net)  # no optimizer: gradients computed directly below
    optimizer = KFAC(net, lr=0.1, curvature=CurvatureConfig(factor_decay=0.0), decomposition_update_steps=1000,
                     factor_update_steps=1)
    x, y = faults_batch()
    x.requires_grad_(True)
    loss = F.cross_entropy(net(x), y)
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    for block in optimizer.blocks:  # the graph-building pass records nothing
        assert block.pending_samples == 0 and not block.G.pending.requires_grad
    (loss + gx.square().sum()).backward()
    # Reference: d(loss + penalty)/d(layer output), computed on an untouched copy.
    x_ref = x.detach().clone().requires_grad_(True)
    h0 = reference_net[0](x_ref)
    h2 = reference_net[2](reference_net[1](h0))
    loss_ref = F.cross_entropy(h2, y)
    (gx_ref,) = torch.autograd.grad(loss_ref, x_ref, create_graph=True)
    grads = torch.autograd.grad(loss_ref + gx_ref.square().sum(), [h0, h2])
    for block, grad in zip(optimizer.blocks, grads, strict=True):
        assert not block.G.pending.requires_grad
        assert block.pending_samples == len(x)  # counted once, not twice
        torch.testing.assert_close(block.G.pending, grad.T @ grad)
    optimizer.step()
    for block in optimizer.blocks:
        assert not block.G.running.requires_grad


def test_gradient_penalty_does_not_grow_a_graph_across_steps() -> None:
    net = faults_mlp()
    optimizer = KFAC(net, lr=0.01, factor_update_steps=1, decomposition_update_steps=2)
    for step in range(4):
        x, y = faults_batch(seed=step)
        x.requires_grad_(True)
        optimizer.zero_grad()
        loss = F.cross_entropy(net(x), y)
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        (loss + gx.square().sum()).backward()
        optimizer.step()
    for block in optimizer.blocks:
        for factor in block.factors.values():
            assert not factor.running.requires_grad and not factor.pending.requires_grad


def test_a_collected_optimizer_takes_its_hooks_with_it() -> None:
    net = faults_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no take-over warning: each optimizer is gone before the next
        for _ in range(3):
            optimizer = KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
            faults_train_step(net, optimizer)
            assert forward_hook_count(net) == 2
            del optimizer
            gc.collect()
            assert forward_hook_count(net) == 0


def test_a_second_live_optimizer_takes_the_model_over_with_a_warning() -> None:
    net = faults_mlp()
    first = KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    with pytest.warns(UserWarning, match="already has a live KFAC") as record:
        second = KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    assert {w.filename for w in record} == {__file__}
    assert forward_hook_count(net) == len(second.blocks)  # only the new optimizer's hooks
    faults_train_step(net, second)
    assert all(block.A.initialized for block in second.blocks)
    assert not any(block.A.initialized for block in first.blocks)  # the old one records nothing


def test_recreating_the_optimizer_keeps_one_hook_per_layer() -> None:
    net = faults_mlp()
    optimizers = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            optimizers.append(KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=10))
    assert forward_hook_count(net) == 2


def test_a_deep_copied_model_does_not_feed_the_originals_factors() -> None:
    torch.manual_seed(0)
    net = faults_mlp()
    optimizer = KFAC(net, lr=0.1, curvature=CurvatureConfig(factor_decay=0.0), factor_update_steps=1,
                     decomposition_update_steps=10)
    ema = copy.deepcopy(net)  # an EMA / teacher copy made after the optimizer
    x, y = faults_batch()
    F.cross_entropy(net(x), y).backward()
    pending = {b.name: b.A.pending.clone() for b in optimizer.blocks}
    F.cross_entropy(ema(x * 10), y).backward()  # a backward through the copy before step()
    for block in optimizer.blocks:
        torch.testing.assert_close(block.A.pending, pending[block.name], rtol=0, atol=0)
        assert block.pending_samples == len(x)


def test_remove_hooks_leaves_no_hooks_on_copies() -> None:
    net = faults_mlp()
    optimizer = KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    twin = copy.deepcopy(net)
    optimizer.remove_hooks()
    assert forward_hook_count(net) == 0
    assert forward_hook_count(twin) == 0


def test_a_copy_of_the_model_can_be_trained_by_its_own_optimizer() -> None:
    """The copy (with the inert placeholders of the original's hooks) trains as a plain model with
    the same parameters that never had an optimizer: the same blocks, factors and step."""
    net = faults_mlp()
    original = KFAC(net, lr=0.1, factor_update_steps=1,
                    decomposition_update_steps=10)  # alive: its hooks were copied too
    twin = copy.deepcopy(net)
    control = faults_mlp()
    control.load_state_dict(net.state_dict())
    optimizers = [KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=10) for model in (twin,
                                                                                                          control)]
    for model, optimizer in zip((twin, control), optimizers, strict=True):
        faults_train_step(model, optimizer)
    twin_optimizer, control_optimizer = optimizers
    assert ([block.name for block in twin_optimizer.blocks] == [block.name for block in control_optimizer.blocks]
            == ["0", "2"])
    for block, reference in zip(twin_optimizer.blocks, control_optimizer.blocks, strict=True):
        assert bool(block.A.initialized) and bool(block.G.initialized)
        for name, factor in block.factors.items():
            assert torch.equal(factor.running, reference.factors[name].running), (block.name, name)
    for (name, p), q in zip(twin.named_parameters(), control.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(twin[0].weight, net[0].weight)  # it stepped
    assert all(block.pending_samples == 0 for block in original.blocks) and len(original.blocks) == 2


def test_a_layer_called_with_keyword_arguments_is_captured() -> None:
    torch.manual_seed(0)
    keyword_net, positional_net = nn.Linear(6, 3), nn.Linear(6, 3)
    positional_net.load_state_dict(keyword_net.state_dict())
    keyword = KFAC(keyword_net, lr=0.1, decomposition_update_steps=1, factor_update_steps=1)
    positional = KFAC(positional_net, lr=0.1, decomposition_update_steps=1, factor_update_steps=1)
    x, y = faults_batch()
    F.cross_entropy(keyword_net(input=x), y).backward()
    F.cross_entropy(positional_net(x), y).backward()
    keyword.step()
    positional.step()
    torch.testing.assert_close(keyword.blocks[0].A.running, positional.blocks[0].A.running, rtol=0, atol=0)
    torch.testing.assert_close(keyword_net.weight, positional_net.weight, rtol=0, atol=0)


# -- faults in the numbers ----------------------------------------------------------------------


def test_one_nan_gradient_entry_stays_in_its_layer() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))
    optimizer = KFAC(net, lr=0.1, decomposition_update_steps=1, kl_clip=1e-3, factor_update_steps=1)
    faults_train_step(net, optimizer)  # decompositions exist from here on
    x, y = faults_batch(seed=1)
    optimizer.zero_grad()
    F.cross_entropy(net(x), y).backward()
    net[2].weight.grad[0, 0] = float("nan")
    optimizer.step()
    assert not torch.isfinite(net[2].weight).all()
    for layer in (net[0], net[4]):
        assert torch.isfinite(layer.weight).all() and torch.isfinite(layer.bias).all()


def test_a_non_finite_layer_is_left_out_of_the_trust_region_and_reported() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    twin = copy.deepcopy(net)
    optimizer = KFAC(net, lr=0.1, decomposition_update_steps=2, kl_clip=1e-4, factor_update_steps=1)
    control = KFAC(twin, lr=0.1, decomposition_update_steps=2, kl_clip=1e-4, factor_update_steps=1)
    faults_train_step(net, optimizer)
    faults_train_step(twin, control)
    x, y = faults_batch(seed=1)
    for model, opt in ((net, optimizer), (twin, control)):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
    net[2].weight.grad.fill_(float("inf"))
    twin[2].weight.grad = twin[2].bias.grad = None  # the control's layer 2 takes no part in the step
    optimizer.step()
    control.step()
    # Layer 0's update is clipped by its own term only, as if layer 2 had no gradient.
    torch.testing.assert_close(net[0].weight, twin[0].weight, rtol=0, atol=0)
    with pytest.warns(RuntimeWarning, match=r"layer '2'.*non-finite gradient") as record:
        faults_train_step(net, optimizer, seed=2)  # step 2 decomposes and reports the earlier step
    assert len([w for w in record if "non-finite gradient" in str(w.message)]) == 1


def test_a_damping_schedule_returning_inf_is_named_when_used() -> None:
    optimizer = KFAC(faults_mlp(), lr=0.1, damping=lambda step: float("inf"), factor_update_steps=1,
                     decomposition_update_steps=10)
    with pytest.raises(ValueError, match="damping"):
        optimizer.step()


# -- checkpoints --------------------------------------------------------------------------------


def trained(width: int = 16, steps: int = 2, **kwargs) -> tuple[nn.Module, KFAC]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3))
    optimizer = KFAC(net, lr=0.1, momentum=0.9, decomposition_update_steps=1, **{"factor_update_steps": 1, **kwargs})
    for step in range(steps):
        faults_train_step(net, optimizer, seed=step)
    return net, optimizer


def state_dict_bytes(optimizer: KFAC) -> bytes:
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    return buffer.getvalue()


def assert_rejected_untouched(optimizer: KFAC, state: dict, match: str) -> None:
    before = state_dict_bytes(optimizer)
    with pytest.raises(ValueError, match=match):
        optimizer.load_state_dict(state)
    assert state_dict_bytes(optimizer) == before


def test_checkpoint_of_another_width_is_rejected_before_anything_changes() -> None:
    _, wide = trained(width=32)
    _, optimizer = trained(width=16, steps=1)
    state = wide.state_dict()
    state["state"] = {}  # keep torch's own checks quiet: the K-FAC entry is what is under test
    assert_rejected_untouched(optimizer, state, r"layer '0'.*G.*shape")


def test_checkpoint_with_a_missing_key_is_rejected_before_anything_changes() -> None:
    _, source = trained()
    _, optimizer = trained(steps=1)
    state = source.state_dict()
    del state["kfac"]["blocks"]["2"]["factors"]["G"]["running"]
    assert_rejected_untouched(optimizer, state, r"layer '2'.*G.*running")


@pytest.mark.parametrize("field", ["running", "decomposition"])
def test_checkpoint_with_a_non_finite_tensor_is_rejected(field: str) -> None:
    _, source = trained()
    _, optimizer = trained(steps=1)
    state = copy.deepcopy(source.state_dict())
    entry = state["kfac"]["blocks"]["0"]["factors"]["A"]
    target = entry[field]["Q"] if field == "decomposition" else entry[field]  # the running factor: packed
    target.view(-1)[1] = float("nan")
    assert_rejected_untouched(optimizer, state, rf"layer '0'.*A.*{field}.*non-finite")


def test_a_non_finite_running_factor_is_reset_by_the_next_fold() -> None:
    net, optimizer = trained(steps=1, curvature=CurvatureConfig(factor_decay=0.9))
    factor = optimizer.blocks[0].A
    factor.running.fill_(float("nan"))  # however it got there
    x, y = faults_batch(seed=5)
    optimizer.zero_grad()
    F.cross_entropy(net(x), y).backward()
    rows = torch.cat([x, torch.ones(len(x), 1)], dim=1)
    optimizer.step()
    torch.testing.assert_close(factor.running, rows.T @ rows / len(x))
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_pickling_or_copying_the_optimizer_says_to_save_the_state_dict() -> None:
    _, optimizer = trained(steps=1)
    for copier in (pickle.dumps, copy.deepcopy, lambda o: torch.save(o, io.BytesIO())):
        with pytest.raises(TypeError, match="state_dict"):
            copier(optimizer)


def test_checkpoint_of_a_compiled_model_loads_into_the_plain_model() -> None:
    torch.manual_seed(0)
    net = faults_mlp()
    compiled = torch.compile(net, backend="eager")
    optimizer = KFAC(compiled, lr=0.1, decomposition_update_steps=1, factor_update_steps=1)
    x, y = faults_batch()
    F.cross_entropy(compiled(x), y).backward()
    optimizer.step()
    assert [block.name for block in optimizer.blocks] == ["0", "2"]
    assert all(block.A.initialized for block in optimizer.blocks)
    state = optimizer.state_dict()
    assert set(state["kfac"]["blocks"]) == {name.rsplit(".", 1)[0] for name in net.state_dict()}
    plain = KFAC(copy.deepcopy(net), lr=0.1, decomposition_update_steps=1, factor_update_steps=1)
    plain.load_state_dict(state)
    for block, loaded in zip(optimizer.blocks, plain.blocks, strict=True):
        torch.testing.assert_close(block.A.running, loaded.A.running, rtol=0, atol=0)
