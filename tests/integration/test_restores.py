"""Restores: a state loaded into a fresh optimizer, or back into the same one after more steps (as an
LR finder does: save, explore, load back), continues exactly as the run that never stopped.

Every comparison is bit for bit (``torch.equal``) on the parameters and every running factor,
against a control run in this process. The batches hold one sample: each Gram matrix is then one
outer product, exactly symmetric on any BLAS, so the packed checkpoint holds the factors exactly
whatever the kernels' summation order (docs/api.md, *Format*).
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import checkpoint_bytes
from torch import nn

from kfac_optim import KFAC, AdaptiveDamping, AsyncConfig, CurvatureConfig, RuntimeConfig

RestoreBatch = tuple[torch.Tensor, torch.Tensor]
RESTORE_STEPS = 8


def restore_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 4))


def restore_batches(steps: int, seed: int) -> list[RestoreBatch]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 6, generator=generator), torch.randint(0, 4, (1,), generator=generator))
            for _ in range(steps)]


def restore_step(model: nn.Module, optimizer: KFAC, batch: RestoreBatch, *, step: bool = True) -> None:
    """One training step on ``batch`` (``step=False``: its forward and backward only)."""
    x, y = batch

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if torch.is_grad_enabled():  # AdaptiveDamping measures the loss again under no_grad
            loss.backward()
        return loss

    if step:
        optimizer.step(closure)
    else:
        closure()


def restore_build(options: dict[str, Any]) -> tuple[nn.Sequential, KFAC]:
    model = restore_mlp()
    return model, KFAC(model, **{"lr": 0.1, "momentum": 0.9, **options})



def load_saved(model: nn.Module, optimizer: KFAC, saved: bytes) -> None:
    state = torch.load(io.BytesIO(saved), weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def run_state(model: nn.Module, optimizer: KFAC) -> dict[str, torch.Tensor]:
    """The parameters and every block's running factors, copied."""
    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    optimizer.estimator.settle_statistics()
    state.update({f"{b.name}.{n}": f.running.clone() for b in optimizer.blocks for n, f in b.factors.items()})
    return state


def assert_same_run(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{where}{name}: max |Δ| {(actual[name] - value).abs().max():.3g}"


def control_run(options: dict[str, Any], data: list[RestoreBatch]) -> dict[str, torch.Tensor]:
    model, optimizer = restore_build(options)
    for batch in data:
        restore_step(model, optimizer, batch)
    return run_state(model, optimizer)


STAGGER = dict(curvature=CurvatureConfig(stagger=True), factor_update_steps=3, decomposition_update_steps=3)
SAME_OPTIMIZER_CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "intervals 2/4": dict(factor_update_steps=2, decomposition_update_steps=4),
    "stagger 3/3": STAGGER,
    "stagger 2/2": dict(curvature=CurvatureConfig(stagger=True), factor_update_steps=2, decomposition_update_steps=2),
    "eigen_adam": dict(method="eigen_adam", lr=0.01),
    "async": dict(asynchronous=AsyncConfig()),
    "async delay 1, 2/4": dict(asynchronous=AsyncConfig(delay=1), factor_update_steps=2, decomposition_update_steps=4),
    "async statistics": dict(runtime=RuntimeConfig(async_statistics=True)),
    "adaptive damping 1/4": dict(damping=AdaptiveDamping(every=2), factor_update_steps=1, decomposition_update_steps=4),
}


@pytest.mark.parametrize("options",
                         [STAGGER, SAME_OPTIMIZER_CASES["stagger 2/2"], dict(STAGGER, asynchronous=AsyncConfig()),
                                     dict(STAGGER, method="eigen_adam", lr=0.01)],
                         ids=["3/3", "2/2", "3/3 async", "3/3 eigen_adam"])
def test_a_staggered_run_resumes_bit_identically_into_a_fresh_optimizer(options: dict[str, Any]) -> None:
    data = restore_batches(RESTORE_STEPS, seed=1)
    expected = control_run(options, data)
    model, optimizer = restore_build(options)
    checkpoints = [checkpoint_bytes(model, optimizer)]
    for batch in data[:5]:  # a checkpoint at every phase of either interval, before and after the phases are fixed
        restore_step(model, optimizer, batch)
        checkpoints.append(checkpoint_bytes(model, optimizer))
    for at, saved in enumerate(checkpoints):
        resumed_model, resumed = restore_build(options)
        load_saved(resumed_model, resumed, saved)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. no "produced no statistics" for the layers of other phases
            for batch in data[at:]:
                restore_step(resumed_model, resumed, batch)
        assert_same_run(run_state(resumed_model, resumed), expected, f"resumed at step {at}: ")


@pytest.mark.parametrize("options", SAME_OPTIMIZER_CASES.values(), ids=SAME_OPTIMIZER_CASES.keys())
@pytest.mark.parametrize("at", [0, 1, 4])
def test_a_state_loaded_back_into_the_same_optimizer_after_more_steps_resumes_bit_identically(
        options: dict[str, Any], at: int) -> None:
    """Save at step ``at``, explore (other batches, a step's forward and backward left without its
    step), load the state back into the same model and optimizer, finish the run."""
    data = restore_batches(RESTORE_STEPS, seed=1)
    expected = control_run(options, data)
    model, optimizer = restore_build(options)
    for batch in data[:at]:
        restore_step(model, optimizer, batch)
    saved = checkpoint_bytes(model, optimizer)
    exploring = restore_batches(5, seed=2)
    for batch in exploring[:4]:
        restore_step(model, optimizer, batch)
    restore_step(model, optimizer, exploring[4], step=False)
    load_saved(model, optimizer, saved)
    for batch in data[at:]:
        restore_step(model, optimizer, batch)
    assert_same_run(run_state(model, optimizer), expected, f"loaded back at step {at}: ")


@pytest.mark.parametrize("entry", [{"0": -1.0}, {"0": float("nan")}, [1.0, 2.0]], ids=["negative", "nan", "list"])
def test_a_stagger_entry_that_does_not_fit_is_refused_naming_it(entry: Any) -> None:
    model, optimizer = restore_build(STAGGER)
    for batch in restore_batches(2, seed=1):
        restore_step(model, optimizer, batch)
    state = optimizer.state_dict()
    assert state["kfac"]["stagger"] is not None  # the phases were fixed at the first step
    state["kfac"]["stagger"] = entry
    _, fresh = restore_build(STAGGER)
    with pytest.raises(ValueError, match="'stagger'"):
        fresh.load_state_dict(state)


def test_a_fresh_optimizer_restores_the_automatic_intervals_from_dcp_and_resumes_bit_identically(tmp_path) -> None:
    """A fresh optimizer has chosen no intervals yet (its entry None) while the saved one has: DCP
    must still find the key and load them."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    data = restore_batches(RESTORE_STEPS, seed=1)
    expected = control_run({}, data)
    model, optimizer = restore_build({})
    restore_step(model, optimizer, data[0])  # step 0 chooses the intervals and decomposes
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state, "kfac": optimizer.kfac_state()}, checkpoint_id=tmp_path)

    resumed_model, resumed = restore_build({})
    assert resumed.estimator.intervals.chosen is None
    model_state, optimizer_state = get_state_dict(resumed_model, resumed)
    state = {"model": model_state, "optim": optimizer_state, "kfac": resumed.kfac_state()}
    dcp.load(state, checkpoint_id=tmp_path)
    set_state_dict(resumed_model, resumed, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert resumed.estimator.intervals.chosen == optimizer.estimator.intervals.chosen
    for batch in data[1:]:
        restore_step(resumed_model, resumed, batch)
    assert_same_run(run_state(resumed_model, resumed), expected, "resumed from DCP: ")
