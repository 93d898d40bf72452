"""The read-only views of a ``KFAC`` optimizer: what a training script, a benchmark or a test reads.

Owns :class:`KFACViews`, the part of ``KFAC`` that only reads: its settings, blocks, method, step
count, the factors this rank decomposes, ``describe()`` and its rows, the bytes communicated,
λ, the schedule's steps, ``memory_usage()``. Every answer is computed from the state now.
Must not know: how a step is taken (``optimizer.py``); it reads the estimator's public parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from kfac_optim.config import KFACOptions
from kfac_optim.layers import ModuleReport
from kfac_optim.methods import Method

if TYPE_CHECKING:
    from kfac_optim.estimator.estimator import KroneckerEstimator
    from kfac_optim.update.adam import AdamOutsideKFAC


class KFACViews:
    """``KFAC``'s read-only properties and reports (a base class of ``KFAC``, which sets the attributes below)."""

    _options: KFACOptions
    estimator: KroneckerEstimator
    param_groups: list[dict[str, Any]]
    _outside_adam: AdamOutsideKFAC | None

    @property
    def options(self) -> KFACOptions:
        """The K-FAC settings every rank shares (read-only; SGD's live in ``param_groups``)."""
        return self._options

    @property
    def blocks(self) -> list[Any]:
        """The ``KroneckerBlock`` of every preconditioned layer, in model order."""
        return self.estimator.blocks

    @property
    def method(self) -> Method:
        return self.estimator.method

    @property
    def steps(self) -> int:
        """Optimizer steps taken (skipped overflow steps excluded)."""
        return self.estimator.steps

    @property
    def capturing(self) -> bool:
        """Whether the hooks record statistics now (the coming step is a factor step; with
        ``CurvatureConfig.stagger``, for the layers that fold on it)."""
        return self.estimator.capture.armed

    @property
    def owned_factors(self) -> tuple[str, ...]:
        """The factors this rank decomposes, ``"<layer>.A"`` / ``"<layer>.G"`` (all on one process)."""
        return self.estimator.strategy.owned_factors()

    @property
    def module_reports(self) -> list[ModuleReport]:
        """:meth:`describe`'s rows as data, one per module with parameters in the param groups, from
        the state now (the groups, ``requires_grad``, the model's modules)."""
        return self.estimator.reports(self._group_parameters())

    def _group_parameters(self) -> set[Tensor]:
        """Every parameter of the param groups now."""
        return {p for group in self.param_groups for p in group["params"]}

    def bytes_communicated(self) -> dict[str, int]:
        """Payload bytes this rank handed to collectives so far, by kind: ``"factors"`` (the
        factor all-reduce), ``"decompositions"`` (agreement and broadcasts) and ``"directions"``
        (preconditioned gradients, ``f < 1``). Flat buffers as sent (packed triangles); zeros on
        one process."""
        return self.estimator.strategy.bytes_communicated()

    def damping_at(self, step: int) -> float:
        """λ at ``step`` (under ``AdaptiveDamping``: λ now, whatever the step)."""
        return self.estimator.damping_at(step)

    @property
    def reduction_ratio(self) -> float | None:
        """``AdaptiveDamping``'s last reduction ratio ρ (None before the first, or without it)."""
        return self.estimator.damping.reduction_ratio

    def is_factor_step(self, step: int) -> bool:
        """Whether some layer folds its statistics at ``step`` (every layer, unless staggered)."""
        return bool(self.estimator.folding_blocks(step))

    def is_decomposition_step(self, step: int) -> bool:
        return self.estimator.is_decomposition_step(step)

    def describe(self) -> str:
        """Every module with parameters in the param groups and what K-FAC does with them now: the
        block that preconditions them (its kind, parameters and factor shapes) or why they take the
        SGD path, then the share of trainable weight-matrix elements (parameters with 2+ dims that
        require grad) that K-FAC preconditions. Computed at each call from the current state."""
        text = self.estimator.describe(self._group_parameters())
        return text if self._outside_adam is None else f"{text}\n{self._outside_adam.describe()}"

    def memory_usage(self) -> dict[str, int]:
        """Bytes of K-FAC state on this rank, by category, and their ``"total"`` (see
        ``KroneckerEstimator.memory_usage``; momentum buffers are SGD's and not counted)."""
        return self.estimator.memory_usage()
