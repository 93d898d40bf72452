"""Staggered factor updates: which blocks fold their statistics on which step.

Owns: the phase of every block (``KFAC(..., curvature=CurvatureConfig(stagger=True))``) and which blocks
fold at a step. Must not know: capture hooks, factor math, collectives (the optimizer passes
in the statistics costs, summed over ranks).

Without staggering every block captures and folds on the steps ``k`` with ``k % I == 0``
(``I = factor_update_steps(k)``), so those steps carry all the Gram-matrix work. With it,
every block ``b`` gets a phase ``p_b ∈ [0, I)`` and folds on the steps with ``k % I == p_b``:
each block still folds once every ``I`` steps, but the blocks' work is spread over the ``I``
steps. Phases are assigned once statistics costs are known (:meth:`FactorStagger.set_costs`,
after the first factor step that recorded statistics, at which all blocks fold together):
greedily, most expensive first (ties by name), each onto the phase with the least cost so far
(lowest phase on ties). A block's cost is ``Σ_factors rows × size`` of its pending statistics
(``rows × n²`` for an ``n × n`` factor: the Gram matrix's work). Blocks of one module (the
projections of an ``nn.MultiheadAttention``) are captured together and share one phase.

With a callable ``factor_update_steps`` the phases are assigned per interval value, against the
interval in force at each step: a block folds at ``k`` iff ``k % I(k) == p_b(I(k))``. When the
interval changes, a block's gap between two folds can differ from either interval once.
The assignment depends only on the costs and names, so it is the same on every rank when the
costs are (the optimizer sums them over ranks).
"""

from __future__ import annotations

from collections.abc import Sequence

from kfac_optim.layers import KroneckerBlock


def assign_phases(costs: Sequence[float], names: Sequence[str], interval: int) -> list[int]:
    """Phases in ``[0, interval)`` for units of ``costs``: greedy, largest cost first (ties by
    name), each onto the least loaded phase (lowest on ties)."""
    load = [0.0] * interval
    phases = [0] * len(costs)
    for unit in sorted(range(len(costs)), key=lambda i: (-costs[i], names[i])):
        phase = min(range(interval), key=lambda p: (load[p], p))
        phases[unit] = phase
        load[phase] += costs[unit]
    return phases


def statistics_cost(block: KroneckerBlock) -> float:
    """The Gram work of ``block``'s pending statistics: ``Σ_factors rows × stored elements``."""
    return float(sum(f.pending_rows * f.elements for f in block.factors.values()))


class FactorStagger:
    """The phases of ``blocks`` (grouped by module) per interval; see the module docstring."""

    def __init__(self, blocks: Sequence[KroneckerBlock]) -> None:
        units: dict[int, list[KroneckerBlock]] = {}
        for block in blocks:
            units.setdefault(id(block.module), []).append(block)
        self.units: list[list[KroneckerBlock]] = list(units.values())
        self.names = [unit[0].name for unit in self.units]
        self.costs: list[float] | None = None
        self._by_interval: dict[int, list[tuple[list[KroneckerBlock], set[int]]]] = {}

    @property
    def ready(self) -> bool:
        """Whether phases exist (costs were set); before, every block folds on every factor step."""
        return self.costs is not None

    def unit_costs(self) -> list[float]:
        """Each unit's statistics cost now (call before folding, at an all-block factor step)."""
        return [sum(statistics_cost(block) for block in unit) for unit in self.units]

    def set_costs(self, costs: Sequence[float] | None) -> None:
        """Fix the costs the phases are assigned from (the same on every rank); None: no phases yet."""
        self.costs = None if costs is None else list(costs)
        self._by_interval.clear()

    def phases(self, interval: int) -> list[int]:
        """The phase of every unit for ``interval`` (needs :attr:`ready`)."""
        assert self.costs is not None
        return assign_phases(self.costs, self.names, interval)

    def _schedule(self, interval: int) -> list[tuple[list[KroneckerBlock], set[int]]]:
        """Per phase: the blocks that fold and the ids of their modules (cached per interval)."""
        schedule = self._by_interval.get(interval)
        if schedule is None:
            schedule = [([], set()) for _ in range(interval)]
            for unit, phase in zip(self.units, self.phases(interval), strict=True):
                schedule[phase][0].extend(unit)
                schedule[phase][1].add(id(unit[0].module))
            self._by_interval[interval] = schedule
        return schedule

    def blocks_at(self, step: int, interval: int) -> list[KroneckerBlock]:
        """The blocks that fold at ``step`` under ``interval``."""
        return self._schedule(interval)[step % interval][0]

    def modules_at(self, step: int, interval: int) -> set[int]:
        """``id()`` of the modules that capture for ``step`` under ``interval``."""
        return self._schedule(interval)[step % interval][1]
