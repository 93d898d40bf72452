"""Same seed, same run: the default automatic intervals are counted from shapes, never timed
(``kfac_optim.schedule.costs``, docs/api.md "Automatic intervals"), and a run saved at any step and loaded
into a freshly built optimizer continues bit-identically (docs/api.md ``state_dict()``).

Every comparison is bit for bit (``torch.equal``) against a control run in this process.
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
from kfac_optim.schedule.intervals import MeasuredIntervals, StepCosts

Batch = tuple[torch.Tensor, torch.Tensor]


def three_layer_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 4))


def batches(steps: int, size: int = 16) -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 6, generator=generator), torch.randint(0, 4, (size,), generator=generator))
            for _ in range(steps)]


def step(model: nn.Module, optimizer: KFAC, batch: Batch) -> None:
    x, y = batch

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if torch.is_grad_enabled():  # AdaptiveDamping measures the loss again under no_grad
            loss.backward()
        return loss

    optimizer.step(closure)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str = "") -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{where}{name}: max |Δ| {(actual[name] - value).abs().max():.3g}"


def test_two_default_runs_are_bit_identical() -> None:
    def run() -> tuple[dict[str, torch.Tensor], KFAC]:
        model = three_layer_mlp()
        optimizer = KFAC(model, lr=0.1, momentum=0.9)
        for batch in batches(30):
            step(model, optimizer, batch)
        return snapshot(model), optimizer

    (first, optimizer), (second, _) = run(), run()
    assert_same_state(second, first)
    assert optimizer.estimator.intervals.chosen is not None


def test_the_default_run_equals_the_run_given_its_chosen_intervals() -> None:
    """Decided before the first step's fold, the default schedule is a plain one from step 0: no
    calibration steps, no fold skipped (and no warning about one)."""
    data = batches(24)
    model = three_layer_mlp()
    default = KFAC(model, lr=0.1, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "recorded no statistics on this factor step"
        for batch in data:
            step(model, default, batch)
    factor, inverse = default.estimator.intervals.chosen
    steps = len(data)
    assert inverse < steps  # decompositions after step 0 use the folds compared
    control_model = three_layer_mlp()
    control = KFAC(control_model, lr=0.1, momentum=0.9, factor_update_steps=factor, decomposition_update_steps=inverse)
    for batch in data:
        step(control_model, control, batch)
    assert_same_state(snapshot(model), snapshot(control_model))


def test_forwards_between_steps_leave_the_default_run_bit_identical() -> None:
    """No-grad forwards (a logging forward between backward and step, a validation pass in eval
    mode) change nothing: not the statistics, not the intervals (which once came from timing the
    steps, these forwards included). A wide layer on a small batch: decompositions are costly
    against the step, so the intervals depend on what the step is weighed as."""
    def wide() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 4))

    def run(forwards: bool) -> tuple[dict[str, torch.Tensor], KFAC]:
        model = wide()
        optimizer = KFAC(model, lr=0.1, momentum=0.9)
        probe = torch.randn(8192, 6, generator=torch.Generator().manual_seed(2))
        for index, (x, y) in enumerate(batches(36, size=8)):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if forwards:
                with torch.no_grad():
                    model(probe)  # logging, in training mode, between backward and step
            optimizer.step()
            if forwards and index % 3 == 0:  # a validation pass
                model.eval()
                with torch.no_grad():
                    model(probe)
                model.train()
        return snapshot(model), optimizer

    (control, control_optimizer), (probed, optimizer) = run(False), run(True)
    assert_same_state(probed, control)
    assert optimizer.estimator.intervals.chosen == control_optimizer.estimator.intervals.chosen
    factor, inverse = optimizer.estimator.intervals.chosen
    assert factor < 36 and inverse < 36  # the run folds and decomposes after step 0


def test_a_measured_decision_that_makes_its_step_a_factor_step_folds_it() -> None:
    """``MeasuredIntervals`` decide at the start of step 3, after its backward: the hooks captured
    for it anyway, so a factor interval of 1 or 3 folds step 3 (once it skipped it, with a warning
    that blamed torch.compile)."""
    costs = StepCosts(step=1.0, factor=0.05, decomposition=0.1)  # share 0.25: factor interval 1
    model = three_layer_mlp()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=MeasuredIntervals(costs=costs),
                     decomposition_update_steps=MeasuredIntervals(costs=costs))
    data = batches(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in data[:3]:
            step(model, optimizer, batch)
        before = {name: factor.running.clone() for name, factor in optimizer.blocks[0].factors.items()}
        step(model, optimizer, data[3])
    assert optimizer.estimator.intervals.chosen == (1, 10)
    assert all(not torch.equal(optimizer.blocks[0].factors[name].running, value) for name, value in before.items())


# -- resume at any step ------------------------------------------------------------------------

RESUME_STEPS = 12
MIXED = [  # (factor_update_steps, decomposition_update_steps)
    ("auto", "auto"),
    ("auto", 2),
    (2, "auto"),
    (2, 4),
]
CASES: dict[str, dict[str, Any]] = {
    **{f"intervals {f}/{i}": dict(factor_update_steps=f, decomposition_update_steps=i) for f, i in MIXED},
    "async": dict(asynchronous=AsyncConfig()),
    "async delay 1, 2/4": dict(asynchronous=AsyncConfig(delay=1), factor_update_steps=2, decomposition_update_steps=4),
    "stagger 3/auto": dict(curvature=CurvatureConfig(stagger=True), factor_update_steps=3),
    "eigen_adam": dict(method="eigen_adam", lr=0.01),
    "adaptive damping 1/4": dict(damping=AdaptiveDamping(every=2), factor_update_steps=1, decomposition_update_steps=4),
    "async, eigen_adam": dict(asynchronous=AsyncConfig(), method="eigen_adam", lr=0.01),
    "async, adaptive damping": dict(asynchronous=AsyncConfig(delay=1), damping=AdaptiveDamping(every=3)),
    "async statistics": dict(runtime=RuntimeConfig(async_statistics=True)),
}


def build(options: dict[str, Any]) -> tuple[nn.Module, KFAC]:
    model = three_layer_mlp()
    return model, KFAC(model, **{"lr": 0.1, "momentum": 0.9, **options})



@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_a_run_saved_at_any_step_resumes_bit_identically(options: dict[str, Any]) -> None:
    """Save after every step 0..N of one run (which must itself equal a run that never saves), load
    each checkpoint into a freshly built model and optimizer, finish the run, compare."""
    data = batches(RESUME_STEPS)
    control_model, control = build(options)
    for batch in data:
        step(control_model, control, batch)
    expected = snapshot(control_model)

    model, optimizer = build(options)
    checkpoints = [checkpoint_bytes(model, optimizer)]
    for batch in data:
        step(model, optimizer, batch)
        checkpoints.append(checkpoint_bytes(model, optimizer))
    assert_same_state(snapshot(model), expected, "the saving run: ")

    for at, checkpoint in enumerate(checkpoints):
        state = torch.load(io.BytesIO(checkpoint), weights_only=True)
        resumed_model, resumed = build(options)
        resumed_model.load_state_dict(state["model"])
        resumed.load_state_dict(state["optimizer"])
        for batch in data[at:]:
            step(resumed_model, resumed, batch)
        assert_same_state(snapshot(resumed_model), expected, f"resumed at step {at}: ")
        assert resumed.estimator.intervals.chosen == control.estimator.intervals.chosen


@pytest.mark.parametrize(("factor", "inverse"), [("auto", 2), (2, "auto"), (lambda step: 2, "auto")],
                         ids=["auto/2", "2/auto", "callable/auto"])
def test_a_checkpoint_with_one_explicit_and_one_automatic_interval_loads(factor: Any, inverse: Any) -> None:
    model, optimizer = build(dict(factor_update_steps=factor, decomposition_update_steps=inverse))
    for batch in batches(5):
        step(model, optimizer, batch)
    state = optimizer.state_dict()
    _, fresh = build(dict(factor_update_steps=factor, decomposition_update_steps=inverse))
    fresh.load_state_dict(state)
    assert fresh.estimator.intervals.chosen == optimizer.estimator.intervals.chosen
    assert fresh.describe().splitlines()[-1] == optimizer.describe().splitlines()[-1]

