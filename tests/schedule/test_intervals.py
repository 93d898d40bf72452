"""Automatic intervals (``kfac_optim.schedule.intervals``): the calibration's schedule, the cost model,
the decision (logged, in describe()) and its revision at re-measured decomposition rounds, and
checkpoints that keep it.

Costs are injected (``AutoIntervals(costs=StepCosts(...))``) wherever the intervals decide what
is compared, so the tests do not depend on this machine's timing; one test measures for real and
checks only what timing cannot change.
"""

from __future__ import annotations

import logging
import math
import warnings
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC
from kfac_optim.schedule.intervals import AutoIntervals, IntervalSchedule, MeasuredIntervals, StepCosts

COSTS = StepCosts(step=0.1, factor=0.05, decomposition=3.5)  # ResNet-18-like: seconds


def intervals_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))


def train(optimizer: KFAC, model: nn.Module, steps: int, first: int = 0) -> None:
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 6, generator=generator), torch.randint(0, 4, (16,), generator=generator))
               for _ in range(first + steps)]
    for x, y in batches[first:]:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_the_cost_model_keeps_the_amortized_curvature_work_within_the_budget() -> None:
    auto = AutoIntervals(overhead=0.5)
    factor, inverse = auto.choose(COSTS, None, None)
    # share = 0.5 · 0.1 / 2 = 0.025 s: factor ceil(0.05 / 0.025) = 2, inverse ceil(3.5 / 0.025) = 140
    assert (factor, inverse) == (2, 140)
    assert COSTS.factor / factor + COSTS.decomposition / inverse <= 0.5 * COSTS.step + 1e-12
    # cheap curvature: K-FAC's customary intervals are the floor; an expensive one meets the caps
    assert auto.choose(StepCosts(1.0, 0.0, 0.001), None, None) == (1, 10)
    assert auto.choose(StepCosts(0.01, 10.0, 1000.0), None, None) == (50, 500)
    # the inverse interval is a multiple of the factor one; an explicit one is kept
    assert auto.choose(StepCosts(0.1, 0.07, 0.3), None, None) == (3, 12)
    assert auto.choose(COSTS, 5, None) == (5, 140)


def test_calibration_then_injected_costs_give_the_same_intervals_every_run(caplog: pytest.LogCaptureFixture) -> None:
    model = intervals_mlp()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=MeasuredIntervals(costs=COSTS),
                     decomposition_update_steps=MeasuredIntervals(costs=COSTS))
    assert [optimizer.is_factor_step(k) for k in range(3)] == [True, True, False]
    assert [optimizer.is_decomposition_step(k) for k in range(3)] == [True, False, False]
    assert "factor_update_steps=auto (measuring)" in optimizer.describe()
    with caplog.at_level(logging.INFO, logger="kfac_optim.schedule.intervals"):
        train(optimizer, model, 4)
    assert "factor_update_steps=2 (auto), decomposition_update_steps=140 (auto)" in caplog.text
    assert optimizer.describe().splitlines()[-1].startswith(
        "intervals: factor_update_steps=2 (auto), decomposition_update_steps=140 (auto)")
    assert [k for k in range(3, 300) if optimizer.is_factor_step(k)][:3] == [4, 6, 8]
    assert [k for k in range(3, 300) if optimizer.is_decomposition_step(k)] == [140, 280]


def test_an_explicit_interval_is_kept_and_the_other_chosen() -> None:
    model = intervals_mlp()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=AutoIntervals(costs=COSTS))
    train(optimizer, model, 4)
    assert optimizer.estimator.intervals.chosen == (1, 140)
    assert all(optimizer.is_factor_step(k) for k in range(10))


def test_measured_intervals_are_decided_once_and_bounded() -> None:
    model = intervals_mlp()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=MeasuredIntervals(),
                     decomposition_update_steps=MeasuredIntervals())
    train(optimizer, model, 3)
    assert optimizer.estimator.intervals.chosen is None  # decided at the start of step 3
    train(optimizer, model, 2, first=3)
    factor, inverse = optimizer.estimator.intervals.chosen
    assert 1 <= factor <= 50 and 10 <= inverse <= 500 and inverse % factor == 0
    costs = optimizer.estimator.intervals.costs
    assert costs.step > 0 and costs.factor >= 0 and costs.decomposition > 0
    train(optimizer, model, 3, first=5)
    assert optimizer.estimator.intervals.chosen == (factor, inverse)  # never re-decided


def test_a_resumed_run_keeps_the_chosen_intervals_and_continues_bit_identically() -> None:
    def build(costs: StepCosts) -> tuple[nn.Module, KFAC]:
        model = intervals_mlp()
        return model, KFAC(model, lr=0.1, momentum=0.9, factor_update_steps=AutoIntervals(costs=costs),
                           decomposition_update_steps=AutoIntervals(costs=costs))

    cheap = StepCosts(step=0.1, factor=0.02, decomposition=0.1)  # (1, 10)
    reference_model, reference = build(cheap)
    train(reference, reference_model, 25)

    model, optimizer = build(cheap)
    train(optimizer, model, 12)
    state, weights = optimizer.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
    assert state["kfac"]["intervals"]["factor"] == 1 and state["kfac"]["intervals"]["inverse"] == 10

    resumed_model, resumed = build(COSTS)  # would choose (2, 140) if it calibrated again
    resumed_model.load_state_dict(weights)
    resumed.load_state_dict(state)
    assert resumed.estimator.intervals.chosen == (1, 10)
    train(resumed, resumed_model, 13, first=12)
    for name, param in reference_model.state_dict().items():
        assert torch.equal(resumed_model.state_dict()[name], param), name


def test_a_checkpoint_with_bad_intervals_is_refused_naming_the_field() -> None:
    model = intervals_mlp()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=AutoIntervals(costs=COSTS),
                     decomposition_update_steps=AutoIntervals(costs=COSTS))
    train(optimizer, model, 4)
    state = optimizer.state_dict()
    state["kfac"]["intervals"]["inverse"] = 0
    with pytest.raises(ValueError, match="intervals.*inverse"):
        optimizer.load_state_dict(state)
    assert optimizer.estimator.intervals.chosen == (2, 140)  # left as it was


def test_auto_intervals_check_their_fields() -> None:
    with pytest.raises(ValueError, match="overhead"):
        AutoIntervals(overhead=0)
    with pytest.raises(ValueError, match="max_inverse"):
        AutoIntervals(max_inverse=5)
    with pytest.raises(ValueError, match="StepCosts.step"):
        StepCosts(step=0.0, factor=0.0, decomposition=0.0)
    with pytest.raises(ValueError, match="StepCosts.factor"):
        StepCosts(step=1.0, factor=math.nan, decomposition=0.0)


def test_the_preconditioning_takes_at_most_half_the_budget() -> None:
    """The preconditioning is paid every step whatever the intervals: it comes out of the budget
    first, but at most half of it, so a model whose preconditioning alone fills the budget still
    refreshes its curvature as a quarter of the budget allows (not once per cap)."""
    auto = AutoIntervals(overhead=0.5)
    costs = StepCosts(step=0.1, factor=0.05, decomposition=3.5, precondition=0.02)
    # share = (0.5 · 0.1 − 0.02) / 2 = 0.015 s: factor ceil(3.33) = 4, inverse ceil(233.3) = 234 → 236
    factor, inverse = auto.choose(costs, None, None)
    assert (factor, inverse) == (4, 236)
    assert costs.precondition + costs.factor / factor + costs.decomposition / inverse <= 0.5 * costs.step + 1e-12
    # from half the budget on: share = (0.05 − 0.025) / 2 = 0.0125 s whatever the preconditioning,
    # factor ceil(4) = 4, inverse ceil(280) = 280; the curvature work stays within a quarter of the budget
    for precondition in (0.025, 0.06, 0.5):
        costs = StepCosts(step=0.1, factor=0.05, decomposition=3.5, precondition=precondition)
        assert auto.choose(costs, None, None) == (4, 280)
        assert costs.factor / 4 + costs.decomposition / 280 <= 0.25 * costs.step + 1e-12


class FakeClock:
    """Seconds that advance only when the test says (the schedule's clock seam)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_schedule(schedule: IntervalSchedule, clock: FakeClock, steps: range,
                 decomposition_cost, sums: list[list[float]], zero_grad: bool = True) -> None:
    """Drive ``schedule`` as the optimizer does: 0.3 s loading a batch, then (``zero_grad`` marks
    the start) plain steps of 1 s, factor steps +0.5 s, preconditioning 0.1 s per step,
    decompositions ``decomposition_cost(step)`` s."""
    def average(values: list[float]) -> list[float]:
        sums.append(values)
        return values  # one rank

    for step in steps:
        clock.now += 0.3
        if zero_grad:
            schedule.step_started(step)
        schedule.begin_step(step, average)
        if schedule.is_factor_step(step):
            clock.now += 0.5
        if schedule.is_decomposition_step(step):
            with schedule.timing_decomposition(step):
                clock.now += decomposition_cost(step)
        with schedule.timing_precondition(step):
            clock.now += 0.1
        clock.now += 0.9
        schedule.step_ended(step)


def test_later_decomposition_rounds_are_measured_again_and_the_inverse_interval_follows() -> None:
    # Decompositions cost 0.1 s at the calibration (low-rank factors), 10 s from step 20 on (full rank).
    clock, sums = FakeClock(), []
    schedule = IntervalSchedule(MeasuredIntervals(), MeasuredIntervals(), torch.device("cpu"), clock=clock)
    run_schedule(schedule, clock, range(0, 4), lambda step: 0.1, sums)
    # SGD-equivalent step 0.9 s, preconditioning 0.1 s: share (0.45 − 0.1)/2 = 0.175 s
    assert asdict(schedule.costs) == pytest.approx(dict(step=0.9, factor=0.5, decomposition=0.1, precondition=0.1))
    assert schedule.chosen == (3, 12)  # ceil(0.5/0.175) = 3; max(10, ceil(0.1/0.175)) = 10 → 12
    assert len(sums) == 1  # the calibration's one all-reduce
    run_schedule(schedule, clock, range(4, 14), lambda step: 0.1, sums)
    assert schedule.chosen == (3, 12) and len(sums) == 2  # round 12 measured (still cheap), averaged at 13
    run_schedule(schedule, clock, range(14, 25), lambda step: 10.0, sums)
    # round 24 takes 10 s: the estimate becomes (0.1 + 10)/2 = 5.05 s → ceil(5.05/0.175) = 29 → 30,
    # decided at the start of step 25 (not yet run)
    assert schedule.chosen == (3, 12)
    run_schedule(schedule, clock, range(25, 26), lambda step: 10.0, sums)
    assert schedule.chosen == (3, 30) and schedule.costs.decomposition == pytest.approx(5.05)
    assert sums[-1] == [pytest.approx(10.0), pytest.approx(0.1), 1.0]  # [decomposition, preconditioning, ranks]
    run_schedule(schedule, clock, range(26, 32), lambda step: 10.0, sums)  # round 30: (5.05 + 10)/2 → 43 → 45
    assert schedule.chosen == (3, 45)
    assert [k for k in range(32, 200) if schedule.is_decomposition_step(k)][:2] == [45, 90]
    # a loop without zero_grad(): the step is measured from the previous step's end (loading included)
    schedule = IntervalSchedule(MeasuredIntervals(), MeasuredIntervals(), torch.device("cpu"), clock=clock)
    run_schedule(schedule, clock, range(0, 4), lambda step: 0.1, sums, zero_grad=False)
    assert schedule.costs.step == pytest.approx(1.2) and schedule.costs.factor == pytest.approx(0.5)
    # not under AsyncConfig (remeasure=False), nor with injected costs or an explicit inverse interval
    for schedule in (IntervalSchedule(MeasuredIntervals(), MeasuredIntervals(), torch.device("cpu"), remeasure=False,
                                      clock=clock),
                     IntervalSchedule(MeasuredIntervals(costs=COSTS), MeasuredIntervals(costs=COSTS),
                                      torch.device("cpu"), clock=clock),
                     IntervalSchedule(MeasuredIntervals(), 12, torch.device("cpu"), clock=clock)):
        sums.clear()
        run_schedule(schedule, clock, range(0, 40), lambda step: 10.0 if step > 10 else 0.1, sums)
        assert len(sums) == (1 if schedule.auto.costs is None else 0)


def test_checkpoints_of_costs_without_preconditioning_still_load() -> None:
    state = {"factor": 2, "inverse": 140, "costs": {"step": 0.1, "factor": 0.05, "decomposition": 3.5}}
    schedule = IntervalSchedule("auto", "auto", torch.device("cpu"))
    schedule.check_state(state)
    schedule.load_state_dict(state, step=50)
    assert schedule.chosen == (2, 140) and schedule.costs.precondition == 0.0


def test_intervals_at_their_caps_warn_once_saying_how_to_override() -> None:
    """Curvature work far over the budget: both intervals at their caps, which changes what K-FAC
    does for the rest of the run, so one RuntimeWarning says so (describe() alone logs at INFO)."""
    costly = StepCosts(step=0.01, factor=10.0, decomposition=1000.0)
    model = intervals_mlp()
    capped = r"reached their caps.*factor_update_steps=50.*decomposition_update_steps=500"
    with pytest.warns(RuntimeWarning, match=capped) as caught:
        optimizer = KFAC(model, lr=0.1, factor_update_steps=AutoIntervals(costs=costly),
                         decomposition_update_steps=AutoIntervals(costs=costly))
        train(optimizer, model, 6)
    assert sum("reached their caps" in str(w.message) for w in caught) == 1
    assert "factor_update_steps= / decomposition_update_steps=" in str(caught[0].message)
    # within the caps: no warning
    model = intervals_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer = KFAC(model, lr=0.1, factor_update_steps=AutoIntervals(costs=COSTS),
                         decomposition_update_steps=AutoIntervals(costs=COSTS))
        train(optimizer, model, 6)
    assert optimizer.estimator.intervals.chosen == (2, 140)
