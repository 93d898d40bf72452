"""The fold schedule: which blocks capture for, and fold at, a step.

Owns: the choice between every block on the factor steps of the intervals (:class:`IntervalFolds`)
and each block on its phase's steps (:class:`StaggeredFolds`, ``CurvatureConfig(stagger=True)``:
``stagger.FactorStagger``'s phases, fixed from the first factor step that recorded statistics,
which folds every block), made once at construction (:func:`fold_schedule`); arming the capture
for a step accordingly; what a checkpoint keeps of it (the phases' costs: the ``"stagger"`` entry,
``kfac_optim.state``'s protocol).
Must not know: the statistics' math, where the fold runs (the statistics pipeline), decompositions.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from kfac_optim.capture.hooks import StatisticsCapture
from kfac_optim.estimator.stagger import FactorStagger
from kfac_optim.layers import KroneckerBlock
from kfac_optim.schedule.intervals import IntervalSchedule

logger = logging.getLogger(__name__)

SumOverRanks = Callable[[list[float], str], list[float]]
"""``DistributionStrategy.sum_over_ranks``: values summed over the ranks (a collective), and what they are."""


class IntervalFolds:
    """Every block of ``blocks`` captures and folds on the factor steps of ``intervals``."""

    def __init__(self, blocks: Sequence[KroneckerBlock], intervals: IntervalSchedule) -> None:
        self.blocks = list(blocks)
        self.intervals = intervals

    def blocks_at(self, step: int) -> list[KroneckerBlock]:
        """The blocks that capture for and fold at ``step``."""
        return self.blocks if self.intervals.is_factor_step(step) else []

    def arm(self, capture: StatisticsCapture, step: int) -> None:
        """Let ``capture`` record for ``step`` when it is a factor step (for its blocks' layers)."""
        capture.arm(bool(self.blocks) and self.intervals.captures_at(step))

    def before_fold(self, settle: Callable[[], None]) -> None:
        """At a factor step, before its fold (``settle``: make the pending statistics readable)."""

    def state_dict(self) -> dict[str, float] | None:
        """What a checkpoint needs to continue the schedule (the ``"stagger"`` entry): nothing here."""
        return None

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` if ``state`` is not None or a dict of unit name to a finite cost >= 0
        (:meth:`StaggeredFolds.state_dict`; checked whatever the schedule, as both read any)."""
        if state is None:
            return
        valid = isinstance(state, dict) and all(
            isinstance(name, str) and isinstance(cost, (int, float)) and not isinstance(cost, bool)
            and math.isfinite(cost) and cost >= 0 for name, cost in state.items())
        if not valid:
            raise ValueError(f"expected None or a dict of layer name to a finite cost >= 0, got {state!r}")

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """Continue the schedule of a checkpoint's ``"stagger"`` entry (checked: :meth:`check_state`)."""


class StaggeredFolds(IntervalFolds):
    """Each block folds on its phase's steps (``stagger.py``); until the phases exist, as
    :class:`IntervalFolds`. The phases come from the statistics costs summed over ranks by
    ``sum_over_ranks`` (a collective, at the same step on every rank)."""

    def __init__(self, blocks: Sequence[KroneckerBlock], intervals: IntervalSchedule,
                 sum_over_ranks: SumOverRanks) -> None:
        super().__init__(blocks, intervals)
        self._stagger = FactorStagger(blocks)
        self._sum_over_ranks = sum_over_ranks

    def blocks_at(self, step: int) -> list[KroneckerBlock]:
        if not self._stagger.ready:
            return super().blocks_at(step)
        return self._stagger.blocks_at(step, self.intervals.factor_interval(step))

    def arm(self, capture: StatisticsCapture, step: int) -> None:
        if not self._stagger.ready:
            super().arm(capture, step)
            return
        only = self._stagger.modules_at(step, self.intervals.factor_interval(step))
        capture.arm(bool(only), only)

    def before_fold(self, settle: Callable[[], None]) -> None:
        """At an all-block factor step: fix the phases from the statistics costs summed over ranks
        (also in Join's shadow step), once some rank recorded statistics."""
        if self._stagger.ready:
            return
        settle()  # the costs are the pending statistics' sizes
        costs = self._sum_over_ranks(self._stagger.unit_costs(), "the stagger phases' cost all-reduce")
        if sum(costs) > 0:
            self._stagger.set_costs(costs)
            logger.debug("stagger phases for the factor interval at hand: %s",
                         dict(zip(self._stagger.names, costs, strict=True)))

    def state_dict(self) -> dict[str, float] | None:
        """The costs the phases come from, ``{unit name: cost}`` (None: no phases yet)."""
        if self._stagger.costs is None:
            return None
        return dict(zip(self._stagger.names, self._stagger.costs, strict=True))

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """The saved run's phases: its costs when they name exactly this model's units; otherwise
        (None: saved before its phases were fixed, or without stagger) none, fixed again at the
        next factor step with statistics, which folds every block."""
        names = self._stagger.names
        self._stagger.set_costs(None if state is None or set(state) != set(names) else [state[n] for n in names])


FoldSchedule = IntervalFolds
"""The fold schedule's interface (:class:`StaggeredFolds` is one)."""


def fold_schedule(blocks: Sequence[KroneckerBlock], intervals: IntervalSchedule, *, stagger: bool,
                  sum_over_ranks: SumOverRanks) -> FoldSchedule:
    """Staggered folds when ``stagger`` (``CurvatureConfig.stagger``), the intervals' otherwise."""
    if stagger:
        return StaggeredFolds(blocks, intervals, sum_over_ranks)
    return IntervalFolds(blocks, intervals)
