"""The cost model of the default automatic intervals: K-FAC's work and the step it is added to,
counted from shapes (docs/api.md "Automatic intervals", docs/design.md §4).

Owns: the unit and the constants (below), and :func:`model_costs`, which adds up one step's costs
of a set of blocks from their factors' shapes, the rows of one batch and the method's own counts
(``Method.decomposition_cost``, ``Method.precondition_cost``).
Must not know: schedules, ranks, clocks, what a block kind is (it reads factors: their ``dim``,
``groups``, ``diagonal`` and ``pending_rows``, and a block's ``forward_rows()``: the rows its forward
multiplied, more than ``A``'s when its statistics reduce them, as a conv's ``Reduce`` does).

**Unit**: a *flop-equivalent* is the time one core takes for one floating-point operation of a large
matrix product (``2·m·n·k`` per ``(m, k) @ (k, n)``). Work that does not run at that rate is
counted at its measured rate in this unit: the constants below were measured with one thread on
the project's CPU box (benchmarks/RESULTS.md "The cost model's constants"; ``python -m
benchmarks.cost_constants`` measures them again) and rounded;
``STEP_EFFICIENCY`` and the operation counts (the fixed cost of a tensor operation, which dominates small layers) were
set so that the counted parts match the measured ones of ``benchmarks.default_cost``'s ResNet-18 and char GPT
(benchmarks/RESULTS.md "The drop-in's cost: the eigenbasis cap and the budgeted intervals"). They are
constants, so the intervals are a pure function of the model, one batch's shapes and the settings: the same on
every run and every rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kfac_optim.schedule.intervals import StepCosts

logger = logging.getLogger(__name__)


class SizedFactor(Protocol):
    """What the cost model reads of a factor (``layers.factor.Factor``)."""

    dim: int
    groups: int
    diagonal: bool
    pending_rows: int


class SizedBlock(Protocol):
    """What the cost model reads of a block (``layers.base.KroneckerBlock``)."""

    factors: Mapping[str, SizedFactor]

    def forward_rows(self) -> int: ...

    @property
    def A(self) -> SizedFactor: ...  # noqa: N802 (the paper's name)

    @property
    def G(self) -> SizedFactor: ...  # noqa: N802

EIGH = 20.0
"""``eigh`` of a dense ``(n, n)`` factor: ``EIGH·n³`` flop-equivalents."""

INVERSE = 5.0
"""A damped Cholesky inverse of a dense ``(n, n)`` factor: ``INVERSE·n³``."""

RANGE = 25.0
"""The randomized range eigensolver (``linalg._top_eigh``, the eigenbasis cap) of an ``(n, n)``
factor at ``c`` columns: ``RANGE·n²·c``."""

POWER_REFRESH = 10.0
"""One warm-started refresh of a basis of ``c`` columns of an ``(n, n)`` factor (``kfac_optim.methods.power_refresh``:
a product and a QR): ``POWER_REFRESH·n²·c`` (measured: ``python -m benchmarks.power_refresh_cost``)."""

ELEMENT = 50.0
"""One memory-bound pass over one element (read-modify-write of float32): copies, folds, scaling."""

FOLD_PASSES = 4
"""Elementwise passes over a dense factor per fold (the running average's scale and add, the
pending sum's clear, its symmetric fill)."""

CAPTURE_PASSES = 4
"""Elementwise passes over a factor's captured rows (detaching, reshaping or unfolding them,
casting to the factor dtype, the bias column's sums)."""

FORWARD_BACKWARD = 6.0
"""Matrix-product flops of a layer's forward and backward per multiply-add of its weight with one
input row: 2 forward, 2 for the input's gradient, 2 for the weight's."""

STEP_EFFICIENCY = 0.25
"""The fraction of the matrix-product rate a training step's forward and backward reach, the work of
the layers K-FAC does not precondition (activations, normalization, attention's score products,
the loss, the optimizer's update) and Python's overhead included: the SGD step's cost is
``Σ FORWARD_BACKWARD·rows·in·out / STEP_EFFICIENCY + OPERATION·STEP_OPERATIONS`` over the layers.
Calibrated on ``benchmarks.default_cost`` (ResNet-18 and the char GPT, docs/tuning.md), whose
measured SGD steps are about 4× their K-FAC layers' matrix-product time at the full rate."""


OPERATION = 1e6
"""The fixed cost of one tensor operation, Python and dispatch included (about 5 µs of a CPU core):
on small layers it outweighs the arithmetic, on both sides of the budget."""

STEP_OPERATIONS = 60
"""Operations a layer adds to a step's forward, backward and update (its module call, autograd's
nodes, the optimizer's per-parameter work), in :data:`OPERATION` units."""

STATISTICS_OPERATIONS = 5
"""Operations per factor of a factor step (the capture's reshape and Gram product, the fold)."""

DECOMPOSITION_OPERATIONS = 5
"""Operations per dense factor of a decomposition round (the solver's call, the rank checks)."""

PRECONDITION_OPERATIONS = 15
"""Operations per block of a step's preconditioning (the joint gradient, the products, the split)."""


def model_costs(blocks: Sequence[SizedBlock],
                decomposition_cost: Callable[[SizedFactor, SizedFactor], tuple[float, float]],
                precondition_cost: Callable[[SizedFactor, SizedFactor], float]) -> StepCosts | None:
    """One step's costs (flop-equivalents) of ``blocks`` from the statistics they hold pending now
    (one batch's rows: call before the fold), or None when none holds any.

    ``decomposition_cost(A, G)``: the decompositions of a block's two factors (``Method.decomposition_cost``);
    ``precondition_cost(A, G)``: one step's preconditioning of its gradient (``Method.precondition_cost``).
    A block that holds no rows (a frozen or silent one) is left out: it has no factors to decompose.
    """
    holding = [block for block in blocks if block.A.pending_rows]
    if not holding:
        return None
    step = factor = decomposition = precondition = 0.0
    for block in holding:
        a, g, uses = block.A, block.G, block.forward_rows()
        step += layer_cost(a, g, uses) / STEP_EFFICIENCY + OPERATION * STEP_OPERATIONS
        factor += sum(statistics_cost(f, f.pending_rows * uses // a.pending_rows) + OPERATION * STATISTICS_OPERATIONS
                      for f in block.factors.values())
        decomposition += sum(decomposition_cost(a, g)) + OPERATION * DECOMPOSITION_OPERATIONS * sum(
            not f.diagonal for f in (a, g))
        precondition += precondition_cost(a, g) + OPERATION * PRECONDITION_OPERATIONS
    return StepCosts(step=step, factor=factor, decomposition=decomposition, precondition=precondition)


def layer_cost(a: SizedFactor, g: SizedFactor, rows: int) -> float:
    """A layer's forward and backward over ``rows`` input rows (``KroneckerBlock.forward_rows``):
    matrix products for a dense ``A`` (``in × out`` multiply-adds per row and group), a lookup of
    ``out`` elements per row for a diagonal one (an embedding's or a normalization's)."""
    if a.diagonal:
        return 3 * ELEMENT * rows * g.dim * a.groups
    return FORWARD_BACKWARD * rows * a.dim * g.dim * a.groups


def statistics_cost(factor: SizedFactor, read_rows: int) -> float:
    """A factor's capture and fold: the Gram product ``2·rows·dim²`` of its pending rows (the
    diagonal's ``rows·dim`` squares), the passes over the ``read_rows`` rows the capture reads to
    make them (its pending rows scaled by the layer's forward rows over ``A``'s: a conv's ``Reduce``
    reads every position for one row per sample), and the fold's over the factor."""
    rows, dim, groups = factor.pending_rows, factor.dim, factor.groups
    if factor.diagonal:
        return ELEMENT * (CAPTURE_PASSES * read_rows * dim + FOLD_PASSES * dim)
    return groups * (2.0 * rows * dim * dim + ELEMENT * (CAPTURE_PASSES * read_rows * dim + FOLD_PASSES * dim * dim))


def dense_decomposition(dim: int, groups: int, per_cube: float) -> float:
    """``groups`` decompositions of a dense ``(dim, dim)`` factor at ``per_cube·dim³`` each."""
    return groups * per_cube * float(dim) ** 3


def rotation_cost(out: int, inner: int, columns: int, groups: int = 1) -> float:
    """Multiplying an ``(out, inner)`` gradient-shaped matrix by an ``(inner, columns)`` basis."""
    return 2.0 * groups * out * inner * columns
