"""``method="inverse"``: π-factored damping with damped inverses (Martens & Grosse 2015).

Owns: :class:`DampedInverse`. Formulas: docs/numerics.md "Methods and the update".
Must not know: modules, hooks, ranks, schedules.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from kfac_optim import linalg
from kfac_optim.methods.base import Basis, Method, factor_cost, rotations_cost
from kfac_optim.methods.decompositions import Decomposer, FactorView, InverseDecomposer
from kfac_optim.methods.registry import register_method
from kfac_optim.schedule import costs


@register_method
class DampedInverse(Method):
    """π-factored damping (Martens & Grosse 2015): ``V = (G + (√λ/π) I)⁻¹ ∇ (A + π√λ I)⁻¹`` with
    ``π = sqrt((tr A / dim A) / (tr G / dim G))`` (1 if either trace is 0), over all blocks of a
    grouped factor together. A diagonal factor's inverse is the vector ``1 / (d + shift)``.
    Dense inverses whatever the rank: no eigenbasis cap (:class:`Eigen`'s ``max_rank``) applies,
    so a wide factor costs O(n³) to invert and O(out·in·n) per step to apply."""

    name = "inverse"
    basis: ClassVar[Basis] = Basis.INVERSE
    decomposer: ClassVar[Decomposer] = InverseDecomposer()

    def shifts(self, a: FactorView, g: FactorView, damping: float) -> tuple[float, float]:
        a_mean, g_mean = a.mean_eigenvalue(), g.mean_eigenvalue()
        pi = (a_mean / g_mean) ** 0.5 if a_mean > 0 and g_mean > 0 else 1.0
        root = damping**0.5
        return pi * root, root / pi

    def decomposition_cost(self, a: FactorView, g: FactorView) -> tuple[float, float]:
        """A Cholesky inverse per dense factor (``costs.INVERSE·n³``)."""
        return factor_cost(a, costs.INVERSE), factor_cost(g, costs.INVERSE)

    def precondition_cost(self, a: FactorView, g: FactorView) -> float:
        """``G⁻¹ ∇ A⁻¹``: one product per dense side."""
        return rotations_cost(a, g, a.dim, g.dim, products=1)

    def precondition(self, grad: Tensor, a: FactorView, g: FactorView, damping: float,
                     state: dict[str, Tensor]) -> Tensor:
        ia, ig = a.decomposition, g.decomposition
        if not (a.diagonal or g.diagonal or a.groups > 1):
            return linalg.inverse_precondition(grad, ia, ig)
        left = grad * ig.unsqueeze(-1) if g.diagonal else ig @ grad
        return left * ia.unsqueeze(-2) if a.diagonal else left @ ia
