"""The distributed plan's work: one item per Kronecker factor of a block, and what each costs.

Owns: :class:`WorkItem` (a factor's block, side, dimension and kind), the canonical item order
(block name, then A before G), and the items' decomposition costs in the plan's unit, asked of
the decomposition method (:func:`item_costs`: ``Method.decomposition_cost``, the same counts the
automatic intervals use, ``kfac_optim.schedule.costs``), so the plan weighs a capped factor at its
randomized eigensolver's cost and an inverse at a Cholesky's, not at a full ``eigh``'s.
Must not know: ranks, the assignment, the KAISA grid, tensors or ``torch.distributed``.

**Unit** (the plan's loads, bounds and shares): one full ``eigh`` of a dense ``(n, n)`` factor
costs ``n³`` (:func:`eigh_cost`); a method's flop-equivalents are converted at ``costs.EIGH``
flop-equivalents per unit. Balancing and every reported ratio are independent of the unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from kfac_optim.methods import Method, method_named
from kfac_optim.schedule import costs

Factor = Literal["A", "G"]
FACTORS: tuple[Factor, Factor] = ("A", "G")
"""The Kronecker factors of a block, in the order used by every per-factor tuple of the plan."""

CostModel = Callable[[int], float]
"""Relative cost of decomposing one ``(dim, dim)`` factor, as a function of ``dim``."""


def eigh_cost(dim: int) -> float:
    """The plan's unit: a full ``eigh`` of a ``(dim, dim)`` factor costs ``dim**3``."""
    return float(dim) ** 3


@dataclass(frozen=True)
class WorkItem:
    """One decomposition to compute: factor ``factor`` of block ``block``.

    ``block`` is the block's unique name (the module name; ``""`` is valid for a root module).
    ``dim`` is ``d_in [+1]`` for ``"A"`` (``+1`` with a bias) and ``d_out`` for ``"G"``. The factor
    kind: dense ``(dim, dim)``, or ``count`` independent dense blocks ``(count, dim, dim)`` (a
    grouped convolution), or with ``diagonal`` a vector ``(dim,)``.
    """

    block: str
    factor: Factor
    dim: int
    diagonal: bool = False
    count: int = 1

    @property
    def elements(self) -> int:
        """Elements of the running factor."""
        return self.dim if self.diagonal else self.count * self.dim * self.dim

    def cost(self, model: CostModel) -> float:
        """The cost under a per-dimension ``model`` (e.g. :func:`eigh_cost`, every dense factor
        decomposed by a full ``eigh``): ``count·model(dim)`` for dense factors, ``dim`` for
        diagonal ones. The plan itself asks the method (:func:`item_costs`)."""
        if self.diagonal:
            return float(self.dim)
        return self.count * _checked(float(model(self.dim)), f"cost({self.dim})")

    def __post_init__(self) -> None:
        if not isinstance(self.block, str):
            raise TypeError(f"block must be a str, got {type(self.block).__name__}")
        if self.factor not in FACTORS:
            raise ValueError(f"factor must be one of {FACTORS}, got {self.factor!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"dim must be an int, got {type(self.dim).__name__}")
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"count must be an int >= 1, got {self.count!r}")


@dataclass(frozen=True)
class FactorShape:
    """What a method's cost reads of a factor (``Method.decomposition_cost``): its dimension, block
    count and kind, the fields of ``layers.factor.Factor`` of the same names."""

    dim: int
    groups: int
    diagonal: bool

    @classmethod
    def of(cls, item: WorkItem) -> FactorShape:
        return cls(item.dim, item.count, item.diagonal)


def work_items(dims: Mapping[str, tuple[int, int]]) -> tuple[WorkItem, ...]:
    """The A and G work items of every block, from ``{block: (dim_A, dim_G)}``, sorted by name."""
    return canonical(
        WorkItem(block, factor, dim)
        for block, pair in dims.items()
        for factor, dim in zip(FACTORS, pair, strict=True)
    )


def item_costs(items: Iterable[WorkItem], method: Method | str = "eigen") -> dict[WorkItem, float]:
    """Each item's decomposition cost in the plan's unit (see the module docstring), asked of
    ``method`` (a :class:`~kfac_optim.methods.Method` or its name) for each block's pair: whether
    the eigenbasis cap applies depends on both factors of a block. Keys in canonical order.

    Raises:
        ValueError: an item given twice, a block without exactly one A and one G item, an unknown
            method name, or a cost that is negative or not finite.
    """
    method = method_named(method)
    result: dict[WorkItem, float] = {}
    for pair in blocks_of(canonical(items)).values():
        a, g = pair
        for item, flops in zip(pair, method.decomposition_cost(FactorShape.of(a), FactorShape.of(g)), strict=True):
            result[item] = _checked(flops / costs.EIGH, f"{type(method).__name__}'s cost of {item.block}.{item.factor}")
    return result


def blocks_of(items: tuple[WorkItem, ...]) -> dict[str, tuple[WorkItem, WorkItem]]:
    """``{block: (A item, G item)}`` of canonical ``items``, in their order.

    Raises:
        ValueError: a block without exactly one A and one G item.
    """
    per_block: dict[str, list[WorkItem]] = {}
    for item in items:
        per_block.setdefault(item.block, []).append(item)
    for name, block_items in per_block.items():
        if tuple(item.factor for item in block_items) != FACTORS:
            raise ValueError(f"block {name!r} needs one A and one G item, got {block_items}")
    return {name: (pair[0], pair[1]) for name, pair in per_block.items()}


def item_key(item: WorkItem) -> tuple[str, str]:
    """The canonical order's key: block name, then factor (A before G)."""
    return (item.block, item.factor)


def canonical(items: Iterable[WorkItem]) -> tuple[WorkItem, ...]:
    """Items sorted by (block, factor); raises ValueError for a (block, factor) given twice."""
    ordered = tuple(sorted(items, key=item_key))
    for first, second in zip(ordered, ordered[1:]):
        if item_key(first) == item_key(second):
            raise ValueError(f"work item {item_key(first)} given more than once")
    return ordered


def _checked(value: float, what: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cost must be finite and >= 0, got {what} = {value}")
    return value
