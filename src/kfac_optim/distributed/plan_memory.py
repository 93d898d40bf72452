"""Memory figures of a distributed work plan: the bytes one rank keeps for K-FAC's state.

Owns: :class:`MemoryEstimate` and :func:`memory_per_rank` (reports and benchmarks read them).
Must not know: how the plan was made, tensors, ``torch.distributed``; a decomposition's size is
the method's (``Method.elements``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kfac_optim.distributed.plan import Plan
from kfac_optim.methods import Method, method_named


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank keeps for K-FAC state (gradients and momentum not included).

    Attributes:
        factors: running A and G factors.
        decompositions: eigendecompositions (``Q`` and ``d``) or inverses.
    """

    factors: int
    decompositions: int

    def __post_init__(self) -> None:
        if self.factors < 0 or self.decompositions < 0:
            raise ValueError(f"byte counts must be >= 0, got {self}")

    @property
    def total(self) -> int:
        """All bytes counted."""
        return self.factors + self.decompositions


def memory_per_rank(
    plan: Plan,
    method: Method | str = "eigen",
    *,
    factor_itemsize: int = 4,
    inv_itemsize: int = 4,
) -> tuple[MemoryEstimate, ...]:
    """Estimate per rank the bytes of factors and decompositions under ``plan``.

    Every rank keeps every block's running factors (:attr:`WorkItem.elements` each: local
    statistics are reduced lazily before decomposition steps). A rank keeps both decompositions of
    each block it is a gradient worker of, of ``method.decomposer.elements(...)`` each (e.g. ``dim**2 + dim``
    for a dense factor's ``Q`` and ``d`` under eigen, ``dim**2`` for its inverse, ``dim`` for a
    diagonal one). ``method``: a :class:`~kfac_optim.methods.Method` or its name. Itemsizes are
    bytes per element (fp32: 4).

    Raises:
        ValueError: an unknown ``method`` or an itemsize < 1.
    """
    method = method_named(method)
    for name, size in (("factor_itemsize", factor_itemsize), ("inv_itemsize", inv_itemsize)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    factors = factor_itemsize * sum(item.elements for item in plan.items)
    decompositions = [0] * plan.world_size
    for item in plan.items:
        elements = method.decomposer.elements(item.diagonal, item.dim, item.count)
        for rank in plan.block(item.block).grad_workers:
            decompositions[rank] += inv_itemsize * elements
    return tuple(MemoryEstimate(factors, d) for d in decompositions)
