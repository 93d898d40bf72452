"""``method="eigen"``: exact damping in the factors' eigenbases, with the eigenbasis cap.

Owns: :class:`Eigen` and the rotations into and out of a pair's eigenbases (:func:`rotate`,
:func:`unrotate`) that the eigen family shares. Formulas: docs/numerics.md "Methods and the update".
Must not know: modules, hooks, ranks, schedules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from kfac_optim import linalg
from kfac_optim.methods.base import Basis, Method, elementwise_cost, factor_cost, rotations_cost
from kfac_optim.methods.decompositions import EigenDecomposer, FactorView
from kfac_optim.methods.registry import register_method
from kfac_optim.schedule import costs

DEFAULT_MAX_RANK = 128
""":class:`Eigen`'s default eigenbasis cap (docs/api.md "Eigenbasis cap"; measured in docs/tuning.md)."""


def thin_solve(a: FactorView, g: FactorView) -> bool:
    """Whether the pair is solved by ``linalg.eigen_precondition`` (two dense ungrouped factors),
    which takes thin and truncated decompositions."""
    return not (a.diagonal or g.diagonal or a.groups > 1 or g.groups > 1)



@register_method
@dataclass(frozen=True)
class Eigen(Method):
    """Exact damping: ``V = Q_G [(Q_Gᵀ ∇ Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ`` (no shifts). A diagonal
    factor is its own eigendecomposition (``Q = I``, ``d`` the diagonal, clamped at 0).

    ``max_rank`` (keyword; None: no cap): the eigenbasis cap. A dense factor wider than it, of a
    pair of dense ungrouped factors, whose rank exceeds it is held as its ``max_rank`` leading
    eigenpairs (a randomized eigensolver, O(n²·max_rank) instead of ``eigh``'s O(n³)) plus one
    isotropic eigenvalue for the rest of its spectrum, their mean; the preconditioning then solves
    that approximation exactly at O(out·in·max_rank) per capped side instead of O(out·in·n)
    (``linalg.symmetric_eigen``, ``linalg.complement_precondition``). Factors within the cap, and
    a capped one's factor of rank ≤ ``max_rank``, are solved exactly as without it. ``describe()``
    names the factors the cap applies to, and the log each factor it truncates.

    Subclasses reuse its decompositions, shipping and costs with their own ``precondition`` and
    :attr:`~Method.basis`: one declaring :attr:`Basis.FULL` gets full eigenbases (no thin bases, no
    cap: ``max_rank`` must be None, else ``ValueError`` at construction naming the method and cap).
    """

    max_rank: int | None = field(default=DEFAULT_MAX_RANK, kw_only=True)
    decomposer: EigenDecomposer = field(init=False, repr=False, compare=False)
    """``EigenDecomposer(max_rank)`` under :attr:`Basis.CAPPED`, full bases under :attr:`Basis.FULL`
    (where the cap never applies; ``capped`` says so)."""

    name: ClassVar[str] = "eigen"
    basis: ClassVar[Basis] = Basis.CAPPED

    def __post_init__(self) -> None:
        if self.max_rank is not None and (isinstance(self.max_rank, bool) or not isinstance(self.max_rank, int)
                                          or self.max_rank < 1):
            raise ValueError(f"Eigen max_rank must be an int >= 1 or None, got {self.max_rank!r}")
        if self.basis is Basis.INVERSE:
            raise TypeError(f"{type(self).__name__} is an Eigen: its basis must be Basis.FULL or Basis.CAPPED, "
                            "not INVERSE")
        if self.basis is Basis.FULL and self.max_rank is not None:
            raise ValueError(
                f"{type(self).__name__} takes full eigenbases (basis=Basis.FULL), so the eigenbasis cap does not "
                f"apply to it: max_rank must be None, got max_rank={self.max_rank!r}"
            )
        object.__setattr__(self, "decomposer", EigenDecomposer(self.max_rank if self.basis is Basis.CAPPED else None))

    def _capped_in_pair(self, factor: FactorView, a: FactorView, g: FactorView) -> bool:
        """Whether the cap truncates ``factor`` of the pair ``(a, g)`` once its rank exceeds the cap."""
        return thin_solve(a, g) and self.capped(factor)

    def decomposition_cost(self, a: FactorView, g: FactorView) -> tuple[float, float]:
        """A capped factor (of a thin-solved pair): the randomized range eigensolver at the cap's
        columns (``costs.RANGE·n²·(max_rank + oversampling)``); the others as :class:`Method`'s."""
        def cost(factor: FactorView) -> float:
            if self._capped_in_pair(factor, a, g):
                columns = self.max_rank + linalg.LOW_RANK_OVERSAMPLE
                return costs.RANGE * float(factor.dim) ** 2 * columns
            return factor_cost(factor, costs.EIGH)

        return cost(a), cost(g)

    def precondition_cost(self, a: FactorView, g: FactorView) -> float:
        """The rotations of ``linalg.eigen_precondition`` (or of the complement's solve, about three
        products per capped side) at each basis's columns: ``max_rank`` for a capped side."""
        a_columns = self.max_rank if self._capped_in_pair(a, a, g) else a.dim
        g_columns = self.max_rank if self._capped_in_pair(g, a, g) else g.dim
        capped = a_columns < a.dim or g_columns < g.dim
        return (rotations_cost(a, g, a_columns, g_columns, products=3 if capped else 2)
                + elementwise_cost(a, g, passes=4))

    def shifts(self, a: FactorView, g: FactorView, damping: float) -> tuple[float, float]:
        return 0.0, 0.0

    def approximations(self, pairs: Sequence[tuple[str, FactorView, FactorView]]) -> str | None:
        capped = [f"{layer}.{side} ({factor.dim})" for layer, a, g in pairs if thin_solve(a, g)
                  for side, factor in (("A", a), ("G", g)) if self.capped(factor)]
        if not capped:
            return None
        return (f"eigenbasis cap max_rank={self.max_rank}: once their rank exceeds it, held as their "
                f"{self.max_rank} leading eigenpairs plus one eigenvalue (the mean of the rest) for the remaining "
                f"directions: {', '.join(capped)}")

    def rank_thresholds(self, a: FactorView, g: FactorView, damping: float) -> tuple[float | None, float | None]:
        """For two dense ungrouped factors (the solve of ``linalg.eigen_precondition``), each factor's
        :func:`linalg.rank_threshold` from the other's trace; None otherwise, and always None under
        :attr:`Basis.FULL` (full bases: every eigenvalue kept)."""
        if self.basis is not Basis.CAPPED or not thin_solve(a, g):
            return None, None
        traces = torch.stack([torch.trace(a.running), torch.trace(g.running)]).tolist()
        return linalg.rank_threshold(damping, traces[1]), linalg.rank_threshold(damping, traces[0])

    def precondition(self, grad: Tensor, a: FactorView, g: FactorView, damping: float,
                     state: dict[str, Tensor]) -> Tensor:
        ea, eg = a.decomposition, g.decomposition
        if not (a.diagonal or g.diagonal or a.groups > 1):
            return linalg.eigen_precondition(grad, ea, eg, damping)
        d_a = ea if a.diagonal else ea.d
        d_g = eg if g.diagonal else eg.d
        rotated = grad if g.diagonal else eg.Q.mT @ grad
        if not a.diagonal:
            rotated = rotated @ ea.Q
        rotated = rotated / (d_g.unsqueeze(-1) * d_a.unsqueeze(-2) + damping)
        if not a.diagonal:
            rotated = rotated @ ea.Q.mT
        return rotated if g.diagonal else eg.Q @ rotated



def rotate(grad: Tensor, a: FactorView, g: FactorView, scratch: Tensor) -> Tensor:
    """``R = U_Gᵀ ∇ U_A``: the joint gradient in the factors' eigenbases (a diagonal factor's is ``I``),
    in a fresh tensor (never ``grad`` itself). ``scratch``: a tensor shaped as ``grad`` that holds
    the intermediate product when both sides rotate (its content is then overwritten)."""
    if g.diagonal and a.diagonal:
        return grad.clone()
    if a.diagonal:
        return g.decomposition.Q.mT @ grad
    if g.diagonal:
        return grad @ a.decomposition.Q
    return torch.matmul(g.decomposition.Q.mT, grad, out=scratch) @ a.decomposition.Q


def unrotate(rotated: Tensor, a: FactorView, g: FactorView, scratch: Tensor) -> Tensor:
    """``U_G R U_Aᵀ``, the inverse of :func:`rotate` (the bases are full and orthonormal), in a fresh
    tensor unless neither side rotates (then ``rotated`` itself); ``scratch`` as in :func:`rotate`."""
    if g.diagonal and a.diagonal:
        return rotated
    if a.diagonal:
        return g.decomposition.Q @ rotated
    if g.diagonal:
        return rotated @ a.decomposition.Q.mT
    return g.decomposition.Q @ torch.matmul(rotated, a.decomposition.Q.mT, out=scratch)
