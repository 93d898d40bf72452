"""The Shampoo-style root method: each damped Kronecker factor to the power ``-1/p``.

Owns :class:`RootKronecker` (``method="root"``), its registration and its preconditioning. It
reuses :class:`~kfac_optim.methods.Eigen`'s decompositions, shipping between ranks, checkpointed
decompositions and costs, declaring :attr:`~kfac_optim.methods.Basis.FULL` so it is handed full
eigenbases only (a matrix root needs every eigenvalue: a thin basis would drop the complement).
Must not know: modules, hooks, ranks, schedules (as ``methods``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from kfac_optim.methods.base import Basis
from kfac_optim.methods.decompositions import FactorView
from kfac_optim.methods.eigen import Eigen, rotate, unrotate
from kfac_optim.methods.registry import register_method

logger = logging.getLogger(__name__)


@register_method
@dataclass(frozen=True, repr=True)
class RootKronecker(Eigen):
    """Shampoo's preconditioner on K-FAC's factors (Gupta, Koren & Singer 2018), for the joint
    gradient ``∇ (out, in)`` (``in`` counting a bias column), ``A (in, in)``, ``G (out, out)``::

        V = (G + λ I)^(-1/p) ∇ (A + λ I)^(-1/p)
          = U_G [(U_Gᵀ ∇ U_A) ⊙ ((d_G + λ)^(-1/p) ((d_A + λ)^(-1/p))ᵀ)] U_Aᵀ

    with ``G = U_G diag(d_G) U_Gᵀ``, ``A = U_A diag(d_A) U_Aᵀ`` the running factors' full
    eigendecompositions (eigenvalues clamped at 0, refreshed on decomposition steps), ``λ`` the
    optimizer's damping (added to each factor: the ``ε`` of Shampoo's ``(L + εI)^(-1/4)``) and
    ``p`` the ``exponent``: 4 is Shampoo's for a 2-D weight, 2 the square root (the ``1/2``
    preconditioner of Adam-like scale), 1 the plain (undamped-product) Kronecker inverse
    ``(G + λI)⁻¹ ∇ (A + λI)⁻¹``. A diagonal factor (an embedding's ``A``) is its own
    eigendecomposition (``U = I``); a grouped factor ``(k, n, n)`` is rooted per block.
    Full eigenbases only (:attr:`Basis.FULL`): no eigenbasis cap (``max_rank`` must be None).
    Stateless: nothing but the decompositions travels between ranks or into checkpoints.
    """

    exponent: float = 4.0
    max_rank: None = field(default=None, kw_only=True, repr=False)
    """No eigenbasis cap: the root weighs every eigenvalue, so the bases stay full."""

    name: ClassVar[str] = "root"
    basis: ClassVar[Basis] = Basis.FULL

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.exponent, bool) or not isinstance(self.exponent, (int, float)) \
                or not 0.0 < self.exponent < math.inf:
            raise ValueError(f"RootKronecker exponent must be a finite number > 0, got {self.exponent!r}")

    def precondition(self, grad: Tensor, a: FactorView, g: FactorView, damping: float,
                     state: dict[str, Tensor]) -> Tensor:
        scratch = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        rotated = rotate(grad, a, g, scratch)
        power = -1.0 / self.exponent
        d_a = a.decomposition if a.diagonal else a.decomposition.d
        d_g = g.decomposition if g.diagonal else g.decomposition.d
        rotated.mul_((d_g + damping).pow_(power).unsqueeze(-1)).mul_((d_a + damping).pow_(power).unsqueeze(-2))
        return unrotate(rotated, a, g, scratch)
