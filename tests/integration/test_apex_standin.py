"""Specification of the CPU Apex stand-in (``tests/apex_standin``) with plain ``torch.optim.SGD``.

Each test states one Apex behaviour that the KFAC Apex tests rely on.

Marked ``apex`` (pytest.ini): plain ``pytest`` runs it, ``pytest -m "not apex"`` leaves out the
whole Apex stand-in suite.
"""

from __future__ import annotations

import copy
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from conftest_apex import fake_apex, install_fake_apex, scaled_step  # noqa: F401  (fake_apex is a fixture)
from torch import nn

pytestmark = pytest.mark.apex

HUGE_SCALE = 2.0**40  # any fp16 gradient of a loss of order 1 overflows at this scale


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=gen)
    return x, (x @ torch.randn(8, 3, generator=gen)).argmax(dim=1)


def _setup(
    amp: ModuleType, opt_level: str, optimizer_cls: type[torch.optim.SGD] = torch.optim.SGD
) -> tuple[nn.Module, torch.optim.SGD]:
    model = _model()
    optimizer = optimizer_cls(model.parameters(), lr=0.1, momentum=0.9)
    return amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)


def _snapshot(model: nn.Module, optimizer: torch.optim.SGD) -> list[torch.Tensor]:
    owned = [p for g in optimizer.param_groups for p in g["params"]]
    momenta = [optimizer.state[p]["momentum_buffer"] for p in owned]
    return [t.detach().clone() for t in [*model.parameters(), *owned, *momenta]]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_training_follows_the_fp32_run(fake_apex: ModuleType, opt_level: str) -> None:
    control = _model()
    control_opt = torch.optim.SGD(control.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch()
    expected = []
    for _ in range(8):
        control_opt.zero_grad()
        loss = F.cross_entropy(control(x), y)
        loss.backward()
        control_opt.step()
        expected.append(loss.item())
    model, optimizer = _setup(fake_apex, opt_level)
    losses = [scaled_step(fake_apex, model, optimizer, *_batch()) for _ in range(8)]
    assert losses[-1] < 0.8 * losses[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-2, atol=0)


def test_o1_keeps_fp32_params_and_runs_linear_layers_in_fp16(fake_apex: ModuleType) -> None:
    model, optimizer = _setup(fake_apex, "O1")
    scaled_step(fake_apex, model, optimizer, *_batch())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert optimizer.param_groups[0]["params"] == list(model.parameters())
    assert model(_batch()[0]).dtype == torch.float16


def test_o1_casts_matmuls_everywhere_until_disable_casts(fake_apex: ModuleType) -> None:
    _setup(fake_apex, "O1")
    a = torch.randn(4, 4, dtype=torch.float64)
    assert torch.mm(a, a).dtype == torch.float16
    assert (a @ a).dtype == torch.float16
    with torch.autocast("cpu", enabled=False):
        assert torch.mm(a, a).dtype == torch.float16
    with fake_apex.disable_casts():
        assert torch.mm(a, a).dtype == torch.float64


def test_o1_step_runs_with_casts_disabled(fake_apex: ModuleType) -> None:
    seen: list[torch.dtype] = []

    class Probe(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            a = torch.randn(2, 2)
            seen.append(torch.mm(a, a).dtype)
            return super().step(closure)

    model, optimizer = _setup(fake_apex, "O1", Probe)
    scaled_step(fake_apex, model, optimizer, *_batch())
    assert seen == [torch.float32]


def test_disable_casts_needs_an_o1_initialize(fake_apex: ModuleType) -> None:
    _setup(fake_apex, "O2")
    with pytest.raises(AttributeError), fake_apex.disable_casts():
        pass


def test_o2_model_is_fp16_except_batchnorm_and_optimizer_owns_fp32_masters(
    fake_apex: ModuleType,
) -> None:
    model, optimizer = _setup(fake_apex, "O2")
    model_params = list(model.parameters())
    scaled_step(fake_apex, model, optimizer, *_batch())
    stash = optimizer._amp_stash
    half, full = torch.float16, torch.float32
    assert [p.dtype for p in model.parameters()] == [half, half, full, full, half, half]
    assert all(p.dtype == torch.float32 for g in optimizer.param_groups for p in g["params"])
    assert [p for p in model_params if p.dtype == torch.float16] == stash.all_fp16_params
    assert stash.all_fp32_from_fp32_params == [model[1].weight, model[1].bias]
    for model_p, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        assert master.shape == model_p.shape and master is not model_p
        torch.testing.assert_close(model_p, master.half(), rtol=0, atol=0)


def test_o2_master_grads_are_unscaled_fp32_copies_of_the_model_grads(fake_apex: ModuleType) -> None:
    model, optimizer = _setup(fake_apex, "O2")
    x, y = _batch()
    with fake_apex.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
        scaled_loss.backward()
    scale = fake_apex._amp_state.loss_scalers[0].loss_scale()
    stash = optimizer._amp_stash
    for model_p, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        assert master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, model_p.grad.float() / scale, rtol=0, atol=0)


def test_o2_second_backward_accumulates_into_master_grads(fake_apex: ModuleType) -> None:
    model, optimizer = _setup(fake_apex, "O2")
    model.eval()  # same batch statistics in both passes
    x, y = _batch()
    masters = optimizer._amp_stash
    grads = []
    for _ in range(2):
        with fake_apex.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled_loss:
            scaled_loss.backward()
        grads.append([m.grad.clone() for m in masters.all_fp32_from_fp16_params])
    for once, twice in zip(*grads):
        torch.testing.assert_close(twice, 2 * once, rtol=0, atol=0)


def test_o2_step_copies_masters_into_model_and_clears_master_grads(fake_apex: ModuleType) -> None:
    model, optimizer = _setup(fake_apex, "O2")
    scaled_step(fake_apex, model, optimizer, *_batch())
    stash = optimizer._amp_stash
    assert all(m.grad is None for m in stash.all_fp32_from_fp16_params)
    for model_p, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        torch.testing.assert_close(model_p, master.half(), rtol=0, atol=0)


def test_o2_step_takes_no_closure(fake_apex: ModuleType) -> None:
    model, optimizer = _setup(fake_apex, "O2")
    with pytest.raises(TypeError):
        optimizer.step(lambda: torch.zeros(()))


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_overflow_skips_the_step_halves_the_scale_and_keeps_all_state(
    fake_apex: ModuleType, opt_level: str
) -> None:
    model, optimizer = _setup(fake_apex, opt_level)
    for _ in range(2):
        scaled_step(fake_apex, model, optimizer, *_batch())
    before = _snapshot(model, optimizer)
    scaler = fake_apex._amp_state.loss_scalers[0]
    scaler._loss_scale = HUGE_SCALE
    step_before = optimizer.step
    scaled_step(fake_apex, model, optimizer, *_batch())
    assert scaler.loss_scale() == HUGE_SCALE / 2
    for old, new in zip(before, _snapshot(model, optimizer)):
        torch.testing.assert_close(new, old, rtol=0, atol=0)
    assert optimizer.step == step_before and not optimizer._amp_stash.already_patched


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_step_after_an_overflow_updates_again(fake_apex: ModuleType, opt_level: str) -> None:
    model, optimizer = _setup(fake_apex, opt_level)
    fake_apex._amp_state.loss_scalers[0]._loss_scale = HUGE_SCALE
    scaled_step(fake_apex, model, optimizer, *_batch())
    fake_apex._amp_state.loss_scalers[0]._loss_scale = 2.0**8
    weights = [model[0].weight, model[1].weight, model[3].weight]  # model[0].bias: BN cancels it
    before = [w.detach().clone() for w in weights]
    scaled_step(fake_apex, model, optimizer, *_batch())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not any(torch.equal(w, b) for w, b in zip(weights, before))


def test_skip_step_resets_most_recent_scale_when_the_optimizer_has_one(
    fake_apex: ModuleType,
) -> None:
    class Tracking(torch.optim.SGD):
        most_recent_scale = 5.0

    model, optimizer = _setup(fake_apex, "O2", Tracking)
    fake_apex._amp_state.loss_scalers[0]._loss_scale = HUGE_SCALE
    scaled_step(fake_apex, model, optimizer, *_batch())
    assert optimizer.most_recent_scale == 1.0 and optimizer.scale_set_by_backward is False


def test_loss_scaler_halves_on_overflow_and_doubles_after_2000_clean_steps(
    fake_apex: ModuleType,
) -> None:
    scaler = fake_apex.scaler.LossScaler("dynamic", min_loss_scale=2.0**15)
    scaler._overflow_buf.fill_(True)
    assert scaler.update_scale() is True and scaler.loss_scale() == 2.0**15
    scaler.clear_overflow_state()
    assert scaler.update_scale() is False and scaler.loss_scale() == 2.0**15
    scaler._overflow_buf.fill_(True)
    assert scaler.update_scale() is True and scaler.loss_scale() == 2.0**15  # floored
    scaler.clear_overflow_state()
    assert not any(scaler.update_scale() for _ in range(1999)) and scaler.loss_scale() == 2.0**15
    assert scaler.update_scale() is False and scaler.loss_scale() == 2.0**16


def test_static_loss_scale_never_skips(fake_apex: ModuleType) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fake_apex.initialize(
        model, optimizer, opt_level="O2", loss_scale=HUGE_SCALE, verbosity=0
    )
    scaled_step(fake_apex, model, optimizer, *_batch())
    assert fake_apex._amp_state.loss_scalers[0].loss_scale() == HUGE_SCALE
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_optimizer_state_dict_round_trips_at_initialize_and_at_lazy_init(
    fake_apex: ModuleType,
) -> None:
    calls: list[int] = []

    class Counting(torch.optim.SGD):
        def load_state_dict(self, state_dict):  # type: ignore[no-untyped-def]
            calls.append(len(state_dict["state"]))
            super().load_state_dict(state_dict)

    model, optimizer = _setup(fake_apex, "O2", Counting)
    assert calls == [0]
    scaled_step(fake_apex, model, optimizer, *_batch())
    assert calls == [0, 0]
    _setup(fake_apex, "O1", Counting)
    assert calls == [0, 0]


def test_amp_state_dict_round_trips_the_loss_scale(fake_apex: ModuleType) -> None:
    model, optimizer = _setup(fake_apex, "O2")
    fake_apex._amp_state.loss_scalers[0]._loss_scale = HUGE_SCALE
    scaled_step(fake_apex, model, optimizer, *_batch())
    saved = copy.deepcopy(fake_apex.state_dict())
    assert saved == {"loss_scaler0": {"loss_scale": HUGE_SCALE / 2, "unskipped": 0}}
    _setup(fake_apex, "O2")
    fake_apex.load_state_dict(saved)
    assert fake_apex.state_dict() == saved
    with pytest.raises(RuntimeError, match="Unexpected key"):
        fake_apex.load_state_dict({"bogus": {}})


def test_teardown_restores_torch_functions() -> None:
    originals = (F.linear, torch.mm, torch.Tensor.__matmul__, torch.Tensor.add_)
    with pytest.MonkeyPatch.context() as monkeypatch:
        amp = install_fake_apex(monkeypatch)
        _setup(amp, "O1")
        assert F.linear is not originals[0]
    assert (F.linear, torch.mm, torch.Tensor.__matmul__, torch.Tensor.add_) == originals
