"""Schedules for the step-dependent hyperparameters of :class:`kfac_optim.KFAC`.

``factor_update_steps``, ``decomposition_update_steps`` and ``damping`` take either a constant or any
callable ``step -> value``; this module offers the KAISA papers' "dynamic update decoupling":
a value multiplied by ``gamma`` at each milestone step (intervals grow 10× late in training, or
damping shrinks). Must not know the optimizer.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

Number = TypeVar("Number", int, float)

__all__ = ["MilestoneSchedule", "resolve"]


@dataclass(frozen=True)
class MilestoneSchedule(Generic[Number]):
    """``initial · gamma**k`` where ``k`` is the number of ``milestones`` ≤ the step.

    Milestones are optimizer steps (``epoch · steps_per_epoch`` for epoch milestones). With an
    int ``initial`` and an int ``gamma`` the values stay ints, as update intervals must.

    >>> intervals = MilestoneSchedule(10, milestones=(1000, 5000), gamma=10)
    >>> intervals(0), intervals(1000), intervals(9999)
    (10, 100, 1000)
    """

    initial: Number
    milestones: Sequence[int] = ()
    gamma: Number = 10

    def __post_init__(self) -> None:
        if list(self.milestones) != sorted(self.milestones):
            raise ValueError(f"milestones must be increasing, got {list(self.milestones)}")
        if self.gamma <= 0:
            raise ValueError(f"gamma must be > 0, got {self.gamma}")

    def __call__(self, step: int) -> Number:
        return self.initial * self.gamma ** bisect.bisect_right(self.milestones, step)


def resolve(value: Number | Callable[[int], Number], step: int) -> Number:
    """The value of a constant-or-callable hyperparameter at ``step``."""
    return value(step) if callable(value) else value
