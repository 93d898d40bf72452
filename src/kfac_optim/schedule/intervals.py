"""K-FAC's update intervals: constants, schedules, or chosen from a cost model ("auto").

Owns: which steps fold statistics (factor steps) and which refresh decompositions (decomposition
steps); for ``"auto"`` the choice of the intervals from the costs of K-FAC's work against the step
it is added to (the budget rule), and the chosen intervals' state (saved in checkpoints).
Must not know: blocks, factors, the optimizer (the estimator calls it at the start of every step's
curvature work, :meth:`IntervalSchedule.begin_step`, and hands it the counted costs).

- :class:`AutoIntervals` (the default, ``"auto"``): the costs are *counted* from shapes
  (``kfac_optim.schedule.costs``), so the intervals are a pure function of the model, the batch
  shapes and the settings: the same on every run and every rank, without a collective. They are
  decided at the start of the first step whose statistics were captured; that step and every one
  before it fold and decompose, so no statistics are lost while deciding.
- :class:`MeasuredIntervals` (opt-in, **not reproducible**: it reads the clock): the costs timed on
  the first steps (steps ``c``, ``c + 1``, ``c + 2``; decided at ``c + 3``, averaged over ranks in one
  all-reduce) and re-timed at every later synchronous decomposition round.

The budget rule, its constants and the calibration: docs/api.md "Automatic intervals" and
docs/design.md §4 "Automatic intervals". An explicit ``factor_update_steps`` or
``decomposition_update_steps`` (int or callable) is kept as given; when a cap binds, one warning says so.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from kfac_optim.diagnostics import warn_user
from kfac_optim.schedule.milestones import resolve
from kfac_optim.state import within

logger = logging.getLogger(__name__)

CALIBRATION_STEPS = 3
""":class:`MeasuredIntervals`: steps ``c, c + 1, c + 2`` are measured; the intervals hold from step ``c + 3``."""

MIN_AUTO_INVERSE = 10
"""The smallest automatic decomposition interval (the customary K-FAC value)."""

Interval = int | Callable[[int], int] | str  # or an AutoIntervals
"""What ``factor_update_steps`` / ``decomposition_update_steps`` take."""


def check_interval(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class StepCosts:
    """The costs the budget rule weighs: the SGD-equivalent ``step``, a factor step's extra, one
    decomposition round, and one step's ``precondition`` (0 in checkpoints of earlier releases).
    In flop-equivalents (``kfac_optim.schedule.costs``) for :class:`AutoIntervals`, in seconds for
    :class:`MeasuredIntervals`; only their ratios matter."""

    step: float
    factor: float
    decomposition: float
    precondition: float = 0.0

    def __post_init__(self) -> None:
        for name in ("step", "factor", "decomposition", "precondition"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"StepCosts.{name} must be a finite number >= 0, got {value!r}")
        if self.step <= 0:
            raise ValueError(f"StepCosts.step must be > 0, got {self.step}")


@dataclass(frozen=True)
class AutoIntervals:
    """``factor_update_steps`` / ``decomposition_update_steps`` chosen from the costs counted from shapes
    (deterministic; module docstring and ``kfac_optim.schedule.costs``).

    ``overhead``: the budget of the curvature's amortized cost, as a fraction of a plain step (> 0;
    the preconditioning takes at most half of it, module docstring).
    ``costs``: given costs instead of counted ones (in any unit: only ratios matter).
    ``max_factor``, ``max_inverse``: caps.
    ``KFAC(factor_update_steps="auto")`` is ``AutoIntervals()``; give the same value to both
    arguments, or to one of them to keep the other explicit.
    """

    overhead: float = 0.5
    costs: StepCosts | None = None
    max_factor: int = 50
    max_inverse: int = 500

    def __post_init__(self) -> None:
        kind = type(self).__name__
        if isinstance(self.overhead, bool) or not (isinstance(self.overhead, (int, float))
                                                   and 0 < self.overhead < math.inf):
            raise ValueError(f"{kind}.overhead must be a finite number > 0, got {self.overhead!r}")
        if self.costs is not None and not isinstance(self.costs, StepCosts):
            raise TypeError(f"{kind}.costs must be a StepCosts or None, got {type(self.costs).__name__}")
        check_interval(f"{kind}.max_factor", self.max_factor)
        check_interval(f"{kind}.max_inverse", self.max_inverse)
        if self.max_inverse < MIN_AUTO_INVERSE:
            raise ValueError(f"{kind}.max_inverse must be >= {MIN_AUTO_INVERSE}, got {self.max_inverse}")

    def choose(self, costs: StepCosts, factor: int | None, inverse: int | None) -> tuple[int, int]:
        """``(I_f, I_d)`` for ``costs``; ``factor`` / ``inverse``: an explicit one to keep (None: choose)."""
        budget = self.overhead * costs.step
        share = (budget - min(costs.precondition, budget / 2)) / 2

        def interval(cost: float, low: int, high: int) -> int:
            return min(max(low, math.ceil(cost / share)), high)

        if factor is None:
            factor = interval(costs.factor, 1, self.max_factor)
        if inverse is None:
            inverse = interval(costs.decomposition, MIN_AUTO_INVERSE, self.max_inverse)
            inverse = math.ceil(inverse / factor) * factor
        return factor, inverse


@dataclass(frozen=True)
class MeasuredIntervals(AutoIntervals):
    """Automatic intervals from the cost *measured* in wall time on the first steps, and re-measured
    at later decomposition rounds (module docstring). Opt-in and **not reproducible**: the clock
    decides which steps fold and decompose, so two runs with the same seed may differ (use
    :class:`AutoIntervals`, the default, for reproducible runs). ``costs``: given costs instead of
    measured ones (the calibration's schedule is followed all the same). Fields as :class:`AutoIntervals`.
    """


def auto_of(factor: Any, inverse: Any) -> AutoIntervals | None:
    """The :class:`AutoIntervals` the two interval settings ask for (``"auto"`` is the default one).

    Raises:
        ValueError: two different ``AutoIntervals``, or a value that is neither.
    """
    autos = [AutoIntervals() if value == "auto" else value for value in (factor, inverse)
             if isinstance(value, (str, AutoIntervals))]
    for name, value in (("factor_update_steps", factor), ("decomposition_update_steps", inverse)):
        if isinstance(value, str) and value != "auto":
            raise ValueError(f"{name} must be an int >= 1, a callable, 'auto' or an AutoIntervals, got {value!r}")
    if len(autos) == 2 and autos[0] != autos[1]:
        raise ValueError(
            f"factor_update_steps={factor!r} and decomposition_update_steps={inverse!r}: give the same "
            "AutoIntervals to both, or an explicit interval to one"
        )
    return autos[0] if autos else None


class IntervalSchedule:
    """The factor and decomposition steps of one optimizer (module docstring).

    ``factor``, ``inverse``: the settings (int, callable, ``"auto"``, :class:`AutoIntervals` or
    :class:`MeasuredIntervals`); ``device``: where the work runs (CUDA is synchronized on measured
    steps to time it); ``remeasure``: time the synchronous decomposition rounds after the decision
    (False when the decompositions run on a background worker); ``clock``: seconds, monotonic.
    """

    def __init__(self, factor: Interval | AutoIntervals, inverse: Interval | AutoIntervals,
                 device: torch.device, remeasure: bool = True,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.auto = auto_of(factor, inverse)
        self.measured = isinstance(self.auto, MeasuredIntervals)
        self._factor = None if _is_auto(factor) else factor
        self._inverse = None if _is_auto(inverse) else inverse
        self._device = device
        self._remeasure = remeasure
        self._clock = clock
        self.chosen: tuple[int, int | None] | None = None  # (I_f, I_d) once decided; I_d None when explicit
        self.costs: StepCosts | None = None
        self._start = 0  # the measured calibration's first step c
        self._ends: dict[int, float] = {}  # clock at the end of calibration steps
        self._starts: dict[int, float] = {}  # clock at their zero_grad(), when the loop calls it
        self._decomposition: float | None = None
        self._precondition: float | None = None
        self._round: int | None = None  # a decomposition round timed after the decision, to average
        self._warned_cap = False

    @property
    def calibrating(self) -> bool:
        return self.auto is not None and self.chosen is None

    def _offset(self, step: int) -> int:
        return step - self._start

    def _timing(self) -> bool:
        """Whether the calibration measures (a :class:`MeasuredIntervals` without given costs, undecided)."""
        return self.calibrating and self.measured and self.auto.costs is None

    def factor_interval(self, step: int) -> int:
        """The explicit factor interval at ``step`` (``CurvatureConfig.stagger`` needs one)."""
        if self._factor is None:
            assert self.chosen is not None, "the stagger needs an explicit or chosen factor interval"
            return self.chosen[0]
        return check_interval("factor_update_steps", resolve(self._factor, step))

    def is_factor_step(self, step: int) -> bool:
        if self._factor is not None:
            return step % check_interval("factor_update_steps", resolve(self._factor, step)) == 0
        if self.chosen is None:
            return self._offset(step) in (0, 1) if self.measured else True
        return step % self.chosen[0] == 0

    def is_decomposition_step(self, step: int) -> bool:
        if self._inverse is not None:
            return step % check_interval("decomposition_update_steps", resolve(self._inverse, step)) == 0
        if self.chosen is None:
            return self._offset(step) == 0 if self.measured else True
        return step % self.chosen[1] == 0

    def captures_at(self, step: int) -> bool:
        """Whether the hooks capture for ``step``: its factor steps, and the step whose start decides
        the measured intervals (its statistics are folded if the decision makes it a factor step)."""
        return self.is_factor_step(step) or (self.measured and self.calibrating
                                             and self._offset(step) == CALIBRATION_STEPS)

    # -- the decision (the estimator's calls) ------------------------------------------------

    def begin_step(self, step: int, average_over_ranks: Callable[[list[float]], list[float]],
                   counted: Callable[[], StepCosts | None] = lambda: None) -> None:
        """At the start of a step's curvature work, before its fold: decide while undecided
        (:class:`AutoIntervals`: from the given or ``counted`` costs, None while no statistics were
        captured; :class:`MeasuredIntervals`: when the calibration's steps are done), or choose the
        measured decomposition interval again after a re-measured round (module docstring)."""
        if self.calibrating and not self.measured:
            costs = self.auto.costs if self.auto.costs is not None else counted()
            if costs is not None:
                self._decide(costs, step)
        elif self.calibrating and step - self._start == CALIBRATION_STEPS:
            self._decide(self._measured_over_ranks(average_over_ranks), step)
        elif self._round is not None and step > self._round:
            self._redecide(average_over_ranks)

    def _measuring_round(self) -> bool:
        """Whether a decomposition step now is one re-measured after the decision."""
        return (self._remeasure and self.chosen is not None and self.measured and self.auto.costs is None
                and self._inverse is None)

    @contextmanager
    def timing_decomposition(self, step: int) -> Iterator[None]:
        """Around a decomposition step: time it when it is the calibration's or a re-measured round."""
        calibration = self._timing() and self._offset(step) == 0
        with self._stopwatch(calibration or self._measuring_round()) as elapsed:
            yield
        if elapsed:
            self._decomposition = elapsed[0]
            self._precondition = None
            if not calibration:
                self._round = step

    @contextmanager
    def timing_precondition(self, step: int) -> Iterator[None]:
        """Around a step's preconditioning: time it on the calibration's plain step and on a
        re-measured decomposition round."""
        timed = (self._timing() and self._offset(step) == CALIBRATION_STEPS - 1) or self._round == step
        with self._stopwatch(timed) as elapsed:
            yield
        if elapsed:
            self._precondition = elapsed[0]

    @contextmanager
    def _stopwatch(self, timed: bool) -> Iterator[list[float]]:
        """When ``timed``, the seconds the block took (the device synchronized around it), appended to
        the yielded list; left empty otherwise."""
        elapsed: list[float] = []
        if not timed:
            yield elapsed
            return
        self._synchronize()
        started = self._clock()
        yield elapsed
        self._synchronize()
        elapsed.append(self._clock() - started)

    def step_started(self, step: int) -> None:
        """At ``optimizer.zero_grad()`` before step ``step``: note the time when it is one the calibration measures."""
        if self._timing() and 0 <= self._offset(step) < CALIBRATION_STEPS:
            self._synchronize()
            self._starts[self._offset(step)] = self._clock()

    def step_ended(self, step: int) -> None:
        """At the end of a step: note the time when it is one the calibration measures."""
        if self._timing() and 0 <= self._offset(step) < CALIBRATION_STEPS:
            self._synchronize()
            self._ends[self._offset(step)] = self._clock()

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _measured(self) -> StepCosts:
        ends, decomposition = self._ends, self._decomposition
        assert len(ends) == CALIBRATION_STEPS, "every calibration step ends (skipped steps are not counted)"
        if decomposition is None:  # an explicit decomposition_update_steps without a decomposition at step c: unused
            assert self._inverse is not None
            decomposition = 0.0
        # a step's start: its zero_grad(), else the previous step's end (step 0 only has the former)
        starts = {offset: self._starts.get(offset, ends.get(offset - 1)) for offset in (1, 2)}
        plain = ends[2] - starts[2]
        precondition = min(self._precondition or 0.0, plain)  # None: no block preconditioned (a joined rank)
        return StepCosts(step=max(plain - precondition, 1e-9), factor=max(0.0, (ends[1] - starts[1]) - plain),
                         decomposition=decomposition, precondition=precondition)

    def _measured_over_ranks(self, average_over_ranks: Callable[[list[float]], list[float]]) -> StepCosts:
        """The calibration's costs (given, or measured and averaged over ranks: one all-reduce)."""
        if self.auto.costs is not None:
            return self.auto.costs
        local = self._measured()
        step, factor, decomposition, precondition, ranks = average_over_ranks(
            [local.step, local.factor, local.decomposition, local.precondition, 1.0])
        return StepCosts(step / ranks, factor / ranks, decomposition / ranks, precondition / ranks)

    def _decide(self, costs: StepCosts, step: int) -> None:
        assert self.auto is not None
        explicit_factor = None if self._factor is None else self.factor_interval(step)
        explicit_inverse = 0 if self._inverse is not None else None
        factor, inverse = self.auto.choose(costs, explicit_factor, explicit_inverse)
        self.chosen, self.costs = (factor, None if self._inverse is not None else inverse), costs
        self._ends.clear()
        self._starts.clear()
        self._decomposition = self._precondition = None
        logger.info("K-FAC %s", self.describe())
        self._warn_at_caps()

    def _redecide(self, average_over_ranks: Callable[[list[float]], list[float]]) -> None:
        """The decomposition interval from the last re-measured round's costs, averaged over ranks."""
        assert self.auto is not None and self.chosen is not None and self.costs is not None
        decomposition, precondition, ranks = average_over_ranks(
            [self._decomposition or 0.0, self._precondition or 0.0, 1.0])
        costs = replace(self.costs, decomposition=(self.costs.decomposition + decomposition / ranks) / 2,
                        precondition=(self.costs.precondition + precondition / ranks) / 2)
        _, inverse = self.auto.choose(costs, self.chosen[0], None)
        if inverse != self.chosen[1]:
            logger.info("K-FAC decomposition_update_steps %d -> %d (auto, re-measured at step %d)", self.chosen[1],
                        inverse,
                        self._round)
        self.chosen, self.costs = (self.chosen[0], inverse), costs
        self._round = self._decomposition = self._precondition = None
        self._warn_at_caps()

    def _warn_at_caps(self) -> None:
        """One warning (per optimizer) when an automatic interval is at its cap: K-FAC then refreshes
        its curvature as rarely as allowed, for the rest of the run."""
        assert self.auto is not None and self.chosen is not None
        capped = [f"{name}={value} (its cap {cap})" for name, value, cap, auto in (
            ("factor_update_steps", self.chosen[0], self.auto.max_factor, self._factor is None),
            ("decomposition_update_steps", self.chosen[1], self.auto.max_inverse, self._inverse is None),
        ) if auto and value is not None and value >= cap]
        if not capped or self._warned_cap:
            return
        self._warned_cap = True
        warn_user(
            f"K-FAC's automatic intervals reached their caps: {', '.join(capped)}, so the curvature is refreshed "
            f"that rarely for the rest of the run: its work costs more than the budget of {self.auto.overhead:g}× "
            f"the step ({self.describe()}). To override, pass factor_update_steps= / "
            "decomposition_update_steps= as ints, or "
            f"an {type(self.auto).__name__}(overhead=..., max_factor=..., max_inverse=...) (docs/api.md "
            "'Automatic intervals')",
            RuntimeWarning,
        )

    def describe(self) -> str:
        """One line: the intervals in effect and where they came from."""
        def text(name: str, value: Any, chosen: int | None) -> str:
            if value is not None:
                return f"{name}={value!r}"
            if chosen is not None:
                return f"{name}={chosen} (auto)"
            return f"{name}=auto ({'measuring' if self.measured else 'counted at the first step with statistics'})"

        chosen = self.chosen or (None, None)
        line = f"intervals: {text('factor_update_steps', self._factor, chosen[0])}, " \
               f"{text('decomposition_update_steps', self._inverse, chosen[1])}"
        if self.costs is not None:
            line += f" from {_seconds(self.costs) if self.measured else _counted(self.costs)}, " \
                    f"budget {self.auto.overhead:g}× the step"
        return line

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any] | None:
        """``{"factor": I_f, "inverse": I_d, "costs": {...}}`` once chosen (an explicit interval's
        entry None), else None."""
        if self.chosen is None:
            return None
        return {"factor": None if self._factor is not None else self.chosen[0],
                "inverse": None if self._inverse is not None else self.chosen[1], "costs": asdict(self.costs)}

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming the field if ``state`` is not None or a :meth:`state_dict`."""
        if state is None:
            return
        if not isinstance(state, dict) or not {"factor", "inverse", "costs"} <= set(state):
            raise ValueError("expected None or a dict with 'factor', 'inverse' and 'costs'")
        for name in ("factor", "inverse"):
            if state[name] is not None:  # None: an explicit interval's
                try:
                    check_interval(name, state[name])
                except ValueError as error:
                    raise ValueError(f"{error} (or None for an explicit one)") from None
        with within("'costs'"):
            try:
                StepCosts(**state["costs"])
            except TypeError as error:
                raise ValueError(str(error)) from None

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Restore :meth:`state_dict` (checked by :meth:`check_state`) at ``step``; None, or a state
        without an interval this schedule chooses (saved where it was explicit): decide afresh from
        ``step``. Explicit intervals are kept as given."""
        self._start, self._decomposition, self._precondition, self._round = step, None, None, None
        self._ends.clear()
        self._starts.clear()
        if self.auto is None:
            return
        factor = None if state is None else state["factor"] if self._factor is None else self.factor_interval(step)
        inverse = None if state is None or self._inverse is not None else state["inverse"]
        if factor is None or (inverse is None and self._inverse is None):
            self.chosen, self.costs = None, None
        else:
            self.chosen, self.costs = (factor, inverse), StepCosts(**state["costs"])


def _is_auto(value: Any) -> bool:
    return isinstance(value, (str, AutoIntervals))


def _seconds(costs: StepCosts) -> str:
    return (f"step {costs.step * 1e3:.1f} ms (SGD-equivalent), preconditioning {costs.precondition * 1e3:.1f} ms, "
            f"factor work {costs.factor * 1e3:.1f} ms, decompositions {costs.decomposition * 1e3:.1f} ms")


def _counted(costs: StepCosts) -> str:
    return (f"counted costs (flop-equivalents, kfac_optim.schedule.costs): step {costs.step:.3g} (SGD-equivalent), "
            f"preconditioning {costs.precondition:.3g}, factor work {costs.factor:.3g}, "
            f"decompositions {costs.decomposition:.3g}")
