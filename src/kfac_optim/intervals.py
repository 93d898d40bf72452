"""K-FAC's update intervals: constants, schedules, or chosen from the measured cost ("auto").

Owns: which steps fold statistics (factor steps) and which refresh decompositions (decomposition
steps); for ``"auto"`` (:class:`AutoIntervals`, the default of ``KFAC``) the calibration that
times the first steps, the cost model that turns the costs into intervals, and the chosen
intervals' state (saved in checkpoints, docs/api.md "Automatic intervals").
Must not know: blocks, factors, the optimizer (the estimator calls it at the points below).

**Calibration** (``c`` = the first step the schedule runs undecided: 0, or the step a checkpoint
saved during calibration resumes at): step ``c`` folds and decomposes, ``c + 1`` folds, ``c + 2``
does neither; the auto intervals decide at the start of step ``c + 3``. Measured, in seconds of
wall time between the ends of consecutive ``step()`` calls (forward, backward and the step):

- ``step``: step ``c + 2``, a plain step (K-FAC's preconditioning included, no curvature work);
- ``factor``: step ``c + 1`` minus step ``c + 2``: the statistics' capture (hooks) and the fold;
- ``decomposition``: the decompositions of step ``c``, timed around them.

The three are averaged over ranks (one all-reduce, at step ``c + 3`` on every rank), so every
rank takes the same intervals. On CUDA the calibration steps synchronize the device to time it;
every other step adds no host sync.

**Cost model.** A step then costs ``step + factor / I_f + decomposition / I_d`` on average; with
the budget ``overhead`` (a fraction of the plain step), each kind of curvature work gets half::

    I_f = clamp(ceil(factor / (overhead·step/2)), 1, max_factor)
    I_d = clamp(ceil(decomposition / (overhead·step/2)), 10, max_inverse), rounded up to a multiple of I_f

so the curvature's amortized cost stays ≤ ``overhead × step`` unless a cap binds (the floor of 10
keeps K-FAC's customary decomposition interval when decompositions are cheap). An explicit
``factor_update_steps`` or ``inv_update_steps`` (int or callable) is kept as given.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kfac_optim.schedules import resolve

logger = logging.getLogger(__name__)

CALIBRATION_STEPS = 3
"""Steps ``c, c + 1, c + 2`` are measured; the intervals hold from step ``c + 3``."""

MIN_AUTO_INVERSE = 10
"""The smallest automatic decomposition interval (the customary K-FAC value)."""

Interval = int | Callable[[int], int] | str  # or an AutoIntervals
"""What ``factor_update_steps`` / ``inv_update_steps`` take."""


def check_interval(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class StepCosts:
    """Measured (or given) seconds: a plain ``step``, a factor step's extra, one decomposition round."""

    step: float
    factor: float
    decomposition: float

    def __post_init__(self) -> None:
        for name in ("step", "factor", "decomposition"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"StepCosts.{name} must be a finite number >= 0, got {value!r}")
        if self.step <= 0:
            raise ValueError(f"StepCosts.step must be > 0, got {self.step}")


@dataclass(frozen=True)
class AutoIntervals:
    """``factor_update_steps`` / ``inv_update_steps`` chosen from the measured cost (module docstring).

    ``overhead``: the budget of the curvature's amortized cost, as a fraction of a plain step (> 0).
    ``costs``: given costs instead of measured ones (deterministic intervals, e.g. in tests; the
    calibration's schedule is followed all the same). ``max_factor``, ``max_inverse``: caps.
    ``KFAC(factor_update_steps="auto")`` is ``AutoIntervals()``; give the same value to both
    arguments, or to one of them to keep the other explicit.
    """

    overhead: float = 0.5
    costs: StepCosts | None = None
    max_factor: int = 50
    max_inverse: int = 500

    def __post_init__(self) -> None:
        if isinstance(self.overhead, bool) or not (isinstance(self.overhead, (int, float)) and 0 < self.overhead < math.inf):
            raise ValueError(f"AutoIntervals.overhead must be a finite number > 0, got {self.overhead!r}")
        if self.costs is not None and not isinstance(self.costs, StepCosts):
            raise TypeError(f"AutoIntervals.costs must be a StepCosts or None, got {type(self.costs).__name__}")
        check_interval("AutoIntervals.max_factor", self.max_factor)
        check_interval("AutoIntervals.max_inverse", self.max_inverse)
        if self.max_inverse < MIN_AUTO_INVERSE:
            raise ValueError(f"AutoIntervals.max_inverse must be >= {MIN_AUTO_INVERSE}, got {self.max_inverse}")

    def choose(self, costs: StepCosts, factor: int | None, inverse: int | None) -> tuple[int, int]:
        """``(I_f, I_d)`` for ``costs``; ``factor`` / ``inverse``: an explicit one to keep (None: choose)."""
        share = self.overhead * costs.step / 2
        if factor is None:
            factor = min(max(1, math.ceil(costs.factor / share)), self.max_factor)
        if inverse is None:
            inverse = min(max(MIN_AUTO_INVERSE, math.ceil(costs.decomposition / share)), self.max_inverse)
            inverse = math.ceil(inverse / factor) * factor
        return factor, inverse


def auto_of(factor: Any, inverse: Any) -> AutoIntervals | None:
    """The :class:`AutoIntervals` the two interval settings ask for (``"auto"`` is the default one).

    Raises:
        ValueError: two different ``AutoIntervals``, or a value that is neither.
    """
    autos = [AutoIntervals() if value == "auto" else value for value in (factor, inverse)
             if isinstance(value, (str, AutoIntervals))]
    for name, value in (("factor_update_steps", factor), ("inv_update_steps", inverse)):
        if isinstance(value, str) and value != "auto":
            raise ValueError(f"{name} must be an int >= 1, a callable, 'auto' or an AutoIntervals, got {value!r}")
    if len(autos) == 2 and autos[0] != autos[1]:
        raise ValueError(
            f"factor_update_steps={factor!r} and inv_update_steps={inverse!r}: give the same AutoIntervals to both, "
            "or an explicit interval to one"
        )
    return autos[0] if autos else None


class IntervalSchedule:
    """The factor and decomposition steps of one optimizer (module docstring).

    ``factor``, ``inverse``: the settings (int, callable, ``"auto"`` or :class:`AutoIntervals`);
    ``device``: where the work runs (CUDA is synchronized on calibration steps to time it).
    """

    def __init__(self, factor: Interval | AutoIntervals, inverse: Interval | AutoIntervals,
                 device: torch.device) -> None:
        self.auto = auto_of(factor, inverse)
        self._factor = None if _is_auto(factor) else factor
        self._inverse = None if _is_auto(inverse) else inverse
        self._device = device
        self.chosen: tuple[int, int] | None = None  # (I_f, I_d) once decided
        self.costs: StepCosts | None = None
        self._start = 0  # the calibration's first step c
        self._ends: dict[int, float] = {}  # perf_counter at the end of calibration steps
        self._decomposition: float | None = None

    @property
    def calibrating(self) -> bool:
        return self.auto is not None and self.chosen is None

    def _offset(self, step: int) -> int:
        return step - self._start

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
            return self._offset(step) in (0, 1)
        return step % self.chosen[0] == 0

    def is_inverse_step(self, step: int) -> bool:
        if self._inverse is not None:
            return step % check_interval("inv_update_steps", resolve(self._inverse, step)) == 0
        if self.chosen is None:
            return self._offset(step) == 0
        return step % self.chosen[1] == 0

    # -- calibration (the estimator's calls) -------------------------------------------------

    def begin_step(self, step: int, average_over_ranks: Callable[[list[float]], list[float]]) -> None:
        """At the start of a step's curvature work: decide when the calibration's steps are done."""
        if self.calibrating and step - self._start == CALIBRATION_STEPS:
            self._decide(average_over_ranks)

    @contextmanager
    def timing_decomposition(self, step: int) -> Iterator[None]:
        """Around a decomposition step: time it when it is the calibration's."""
        timed = self.calibrating and self.auto.costs is None and self._offset(step) == 0
        if timed:
            self._synchronize()
            started = time.perf_counter()
        yield
        if timed:
            self._synchronize()
            self._decomposition = time.perf_counter() - started

    def step_ended(self, step: int) -> None:
        """At the end of a step: note the time when it is one the calibration measures."""
        if self.calibrating and self.auto.costs is None and 0 <= self._offset(step) < CALIBRATION_STEPS:
            self._synchronize()
            self._ends[self._offset(step)] = time.perf_counter()

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _measured(self) -> StepCosts:
        ends, decomposition = self._ends, self._decomposition
        assert len(ends) == CALIBRATION_STEPS, "every calibration step ends (skipped steps are not counted)"
        if decomposition is None:  # an explicit inv_update_steps without a decomposition at step c: unused
            assert self._inverse is not None
            decomposition = 0.0
        plain = ends[2] - ends[1]
        return StepCosts(step=max(plain, 1e-9), factor=max(0.0, (ends[1] - ends[0]) - plain),
                         decomposition=decomposition)

    def _decide(self, average_over_ranks: Callable[[list[float]], list[float]]) -> None:
        assert self.auto is not None
        if self.auto.costs is not None:
            costs = self.auto.costs
        else:
            local = self._measured()
            step, factor, decomposition, ranks = average_over_ranks(
                [local.step, local.factor, local.decomposition, 1.0])
            costs = StepCosts(step / ranks, factor / ranks, decomposition / ranks)
        explicit_factor = None if self._factor is None else self.factor_interval(self._start + CALIBRATION_STEPS)
        explicit_inverse = 0 if self._inverse is not None else None
        factor, inverse = self.auto.choose(costs, explicit_factor, explicit_inverse)
        self.chosen, self.costs = (factor, inverse), costs
        self._ends.clear()
        logger.info("K-FAC %s", self.describe())

    def describe(self) -> str:
        """One line: the intervals in effect and where they came from."""
        def text(name: str, value: Any, chosen: int | None) -> str:
            if value is not None:
                return f"{name}={value!r}"
            return f"{name}={chosen} (auto)" if chosen is not None else f"{name}=auto (measuring)"

        chosen = self.chosen or (None, None)
        line = f"intervals: {text('factor_update_steps', self._factor, chosen[0])}, " \
               f"{text('inv_update_steps', self._inverse, chosen[1])}"
        if self.costs is not None:
            line += f" from {_seconds(self.costs)}, budget {self.auto.overhead:g}× the step"
        return line

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any] | None:
        """``{"factor": I_f, "inverse": I_d, "costs": {...}}`` once chosen, else None."""
        if self.chosen is None:
            return None
        return {"factor": self.chosen[0], "inverse": self.chosen[1], "costs": asdict(self.costs)}

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Restore :meth:`state_dict` (checked by :func:`check_state`) at ``step``; None: calibrate
        afresh from ``step``. Explicit intervals are kept as given."""
        self._start, self._decomposition = step, None
        self._ends.clear()
        if self.auto is None:
            return
        if state is None:
            self.chosen, self.costs = None, None
        else:
            self.chosen, self.costs = (state["factor"], state["inverse"]), StepCosts(**state["costs"])


def check_state(state: Any) -> None:
    """Check a checkpoint's ``"intervals"`` entry (:meth:`IntervalSchedule.state_dict`).

    Raises:
        ValueError: naming the field that does not fit.
    """
    if state is None:
        return
    if not isinstance(state, dict) or not {"factor", "inverse", "costs"} <= set(state):
        raise ValueError("K-FAC checkpoint: 'intervals' must be None or a dict with 'factor', 'inverse' and 'costs'")
    for name in ("factor", "inverse"):
        try:
            check_interval(name, state[name])
        except ValueError as error:
            raise ValueError(f"K-FAC checkpoint, 'intervals': {error}") from None
    try:
        StepCosts(**state["costs"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"K-FAC checkpoint, 'intervals' costs: {error}") from None


def _is_auto(value: Any) -> bool:
    return isinstance(value, (str, AutoIntervals))


def _seconds(costs: StepCosts) -> str:
    return (f"step {costs.step * 1e3:.1f} ms, factor work {costs.factor * 1e3:.1f} ms, "
            f"decompositions {costs.decomposition * 1e3:.1f} ms")
