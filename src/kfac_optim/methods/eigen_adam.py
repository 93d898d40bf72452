"""``method="eigen_adam"``: Adam's second moment in K-FAC's eigenbasis (EigenAdam).

Owns: :class:`EigenAdam`, its per-block moments, its thin bases for wide factors and the choice of
basis refresh (:data:`REFRESHES`). Formulas: docs/numerics.md "Eigen-Adam".
Must not know: modules, hooks, ranks, schedules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from kfac_optim import linalg
from kfac_optim.methods.base import Basis, elementwise_cost, factor_cost, rotations_cost
from kfac_optim.methods.decompositions import EigenDecomposer, FactorView
from kfac_optim.methods.eigen import Eigen, rotate, unrotate
from kfac_optim.methods.power_refresh import PowerRefreshDecomposer
from kfac_optim.methods.registry import register_method
from kfac_optim.schedule import costs

EIGEN_ADAM_MAX_RANK = 128
EIGEN_ADAM_THIN_WIDTH = 256
""":class:`EigenAdam`'s default thin basis: factors wider than 256 keep 128 eigenvectors (measured in
docs/tuning.md: below about 2.25× the rank the thin update costs as much as the full one)."""



REFRESHES: dict[str, type[EigenDecomposer]] = {"eigh": EigenDecomposer, "power": PowerRefreshDecomposer}
""":class:`EigenAdam`'s ``refresh`` choices: how a held basis is refreshed at a decomposition step."""



@register_method
@dataclass(frozen=True, repr=True)
class EigenAdam(Eigen):
    """Adam's second moment in K-FAC's eigenbasis: the eigenvalue-corrected K-FAC of George et al.
    (NeurIPS 2018) in the Adam form that SOAP uses in Shampoo's basis (Vyas et al. 2024).

    With ``U_A``, ``U_G`` the eigenvectors of the running factors (refreshed on decomposition steps,
    as :class:`Eigen`'s) and the joint gradient ``∇ (out, in [+1])``::

        R = U_Gᵀ ∇ U_A                                       (rotated gradient)
        v ← β₂ v + (1 − β₂) R²,   t ← t + 1                  (per block, elementwise)
        V = U_G [R / (sqrt(v / (1 − β₂ᵗ)) + ε)] U_Aᵀ

    The factors' eigenvalues and the damping ``λ`` do not enter: ``v`` replaces ``d_G d_Aᵀ + λ``
    (the per-entry second moment George et al. estimate from per-sample gradients is here the
    running mean of the mini-batch gradient's, as in SOAP); ``ε`` is the only regularizer. The
    first moment is SGD's momentum, applied after the KL clip on ``V`` (``beta1`` None), or, with
    ``beta1`` (keyword, in [0, 1)), SOAP's: Adam's first moment of the gradient, kept by the method
    in the parameters' coordinates and rotated with the bases held now, over the root::

        m ← β₁ m + (1 − β₁) ∇,   V = U_G [U_Gᵀ (m / (1 − β₁ᵗ)) U_A / (sqrt(v̂) + ε)] U_Aᵀ

    (two more products per step; the param groups then need ``momentum=0``, and the parameters
    outside K-FAC take ``beta1`` as their β₁: :meth:`first_moment`).
    A diagonal factor (an embedding's ``A``) has the identity as its basis, so its side is not
    rotated. When the bases are refreshed ``v`` is kept as is, not re-projected (SOAP's choice:
    the running factors and so the bases move slowly, and nothing else need be held).

    ``max_rank``, ``thin_width`` (keywords; ``max_rank`` None: full bases everywhere): the thin basis
    of wide factors. A dense factor wider than ``thin_width`` (≥ ``max_rank``), of a pair of dense
    ungrouped factors, is held as at most ``max_rank`` leading eigenvectors ``Q`` (:class:`Eigen`'s cap: a randomized
    eigensolver, O(n²·max_rank); its isotropic ``σ`` is not used). Its side's ``U`` above is then ``Q (n, r)``, and the
    part of the gradient outside the kept eigenvectors, ``O = ∇ − U_G R U_Aᵀ``, takes Adam's elementwise
    update in the parameters' own coordinates with its own second moment::

        w ← β₂ w + (1 − β₂) O²,   V = U_G [R / (sqrt(v̂) + ε)] U_Aᵀ + O / (sqrt(w / (1 − β₂ᵗ)) + ε)

    at O(out·in·max_rank) per capped side instead of O(out·in·n). A pair with no capped side is
    computed as without the cap, bit for bit (no ``w``). When a thin basis changes its column
    count (the factor's rank grows in the first steps) ``v`` keeps its entries of the leading
    eigenvectors (its trailing rows and columns) and the new ones start at 0.
    A step whose gradient has a non-finite entry leaves the state unchanged (its direction is
    non-finite, and the KL clip leaves that layer out and reports it).
    With ``beta1`` and a capped side, ``m̂`` is split as ``∇`` is and its two parts take the places
    of ``R`` and ``O`` over the roots. State per block: ``v`` (shaped as ``R``, in the decomposition
    dtype), ``t``, ``w`` (shaped as the joint gradient) when a side is capped, and ``m`` (shaped as
    the joint gradient) with ``beta1``.

    ``refresh`` (keyword, :data:`REFRESHES`): how a held basis is refreshed at a decomposition step.
    ``"eigh"`` (the default): decomposed afresh (``eigh``, or the cap's randomized eigensolver), its
    columns in ascending order of the eigenvalues. ``"power"``: SOAP's refresh, one step of orthogonal
    iteration warm-started from the basis held, ``Q ← QR(F·Q)`` with the columns orthonormalized in
    the order of their estimated eigenvalues and each written back to its slot, so ``v`` stays
    aligned with it unpermuted (``kfac_optim.methods.power_refresh``; the first decomposition, and a
    restore that holds no basis, is ``"eigh"``'s). It costs one product and one QR (O(n²·max_rank)
    on a capped side, against the eigensolver's three QRs; docs/tuning.md "EigenAdam's basis
    refresh"), so the bases can follow the factors every few steps.
    """

    beta2: float = 0.95
    eps: float = 1e-8
    max_rank: int | None = field(default=EIGEN_ADAM_MAX_RANK, kw_only=True)
    thin_width: int = field(default=EIGEN_ADAM_THIN_WIDTH, kw_only=True)
    beta1: float | None = field(default=None, kw_only=True)
    refresh: str = field(default="eigh", kw_only=True)

    name: ClassVar[str] = "eigen_adam"
    basis: ClassVar[Basis] = Basis.CAPPED
    stateful: ClassVar[bool] = True
    uses_damping: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"EigenAdam beta2 must be in [0, 1), got {self.beta2}")
        if not 0.0 < self.eps < math.inf:
            raise ValueError(f"EigenAdam eps must be a finite number > 0, got {self.eps}")
        if self.beta1 is not None and (isinstance(self.beta1, bool) or not isinstance(self.beta1, int | float)
                                       or not 0.0 <= self.beta1 < 1.0):
            raise ValueError(f"EigenAdam beta1 must be None or a number in [0, 1), got {self.beta1!r}")
        if isinstance(self.thin_width, bool) or not isinstance(self.thin_width, int) or (
                self.max_rank is not None and self.thin_width < self.max_rank):
            raise ValueError(f"EigenAdam thin_width must be an int >= max_rank ({self.max_rank}), "
                             f"got {self.thin_width!r}")
        if self.refresh not in REFRESHES:
            raise ValueError(f"EigenAdam refresh must be one of {sorted(REFRESHES)}, got {self.refresh!r}")
        cap = (self.max_rank, self.thin_width) if self.max_rank is not None else (None, None)
        object.__setattr__(self, "decomposer", REFRESHES[self.refresh](*cap))

    def outside_kfac(self) -> tuple[float, float] | None:
        """Adam's update with this method's ``(beta2, eps)`` (its directions have Adam's scale)."""
        return self.beta2, self.eps

    def first_moment(self) -> float | None:
        """:attr:`beta1` (None: SGD's momentum on the directions)."""
        return self.beta1

    def rank_thresholds(self, a: FactorView, g: FactorView, damping: float) -> tuple[float | None, float | None]:
        """0 for a capped factor (thin: its rounding-floor eigenvalues dropped, at most ``max_rank``
        kept), None (the full basis) for every other: the damping does not enter."""
        return (0.0 if self._capped_in_pair(a, a, g) else None), (0.0 if self._capped_in_pair(g, a, g) else None)

    def decomposition_cost(self, a: FactorView, g: FactorView) -> tuple[float, float]:
        """``refresh="power"``: a dense factor's refresh at ``costs.POWER_REFRESH·n²·c`` per block (``c``:
        ``max_rank`` on a capped side, else ``n``; the first decomposition's ``eigh`` is not counted);
        ``"eigh"``: :class:`Eigen`'s."""
        if self.refresh == "eigh":
            return super().decomposition_cost(a, g)

        def cost(factor: FactorView) -> float:
            if self._capped_in_pair(factor, a, g):
                return costs.POWER_REFRESH * float(factor.dim) ** 2 * self.max_rank
            return factor_cost(factor, costs.POWER_REFRESH)

        return cost(a), cost(g)

    def precondition_cost(self, a: FactorView, g: FactorView) -> float:
        """Full rotations and Adam's elementwise update of the rotated gradient (about ten passes);
        with a capped side, three rotations at ``max_rank`` columns there (the projection) and
        about ten more passes for the outside part. With ``beta1``, the rotation of ``m̂`` (one
        product per side more, two with a capped side) and its update (about three passes)."""
        a_columns = self.max_rank if self._capped_in_pair(a, a, g) else a.dim
        g_columns = self.max_rank if self._capped_in_pair(g, a, g) else g.dim
        first = self.beta1 is not None
        if a_columns == a.dim and g_columns == g.dim:
            return (rotations_cost(a, g, a.dim, g.dim, products=2 + first)
                    + elementwise_cost(a, g, passes=10 + 3 * first))
        return (rotations_cost(a, g, a_columns, g_columns, products=3 + 2 * first)
                + elementwise_cost(a, g, passes=20 + 3 * first))

    def approximations(self, pairs: Sequence[tuple[str, FactorView, FactorView]]) -> str | None:
        capped = [f"{layer}.{side} ({factor.dim})" for layer, a, g in pairs
                  for side, factor in (("A", a), ("G", g)) if self._capped_in_pair(factor, a, g)]
        if not capped:
            return None
        return (f"thin eigenbasis max_rank={self.max_rank} above width {self.thin_width}: at most {self.max_rank} "
                f"leading eigenvectors, the gradient outside them takes elementwise Adam: {', '.join(capped)}")

    def precondition(self, grad: Tensor, a: FactorView, g: FactorView, damping: float,
                     state: dict[str, Tensor]) -> Tensor:
        if _thin_side(a) or _thin_side(g):
            return self._thin_precondition(grad, a, g, state)
        # Three tensors shaped as ∇ per call (R, one scratch, the result) and the rest in place:
        # on a CPU, fresh pages for each temporary cost more than this elementwise arithmetic.
        scratch = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
        rotated = rotate(grad, a, g, scratch)
        v, t = self._moments(state, rotated)
        # 0·x is 0 for every finite x and nan for ±inf and nan: R is finite iff Σ 0·R = 0 (on the device).
        finite = torch.mul(rotated, 0.0, out=scratch).sum().eq(0)
        t.add_(finite.to(t.dtype))
        torch.mul(v, self.beta2, out=scratch).addcmul_(rotated, rotated, value=1.0 - self.beta2)
        torch.where(finite, scratch, v, out=v)
        if self.beta1 is not None:  # Adam's m̂, rotated with the bases held now, replaces R above the root
            rotated = rotate(self._first_moment(state, grad, finite, t), a, g, scratch)
        torch.div(v, 1.0 - torch.pow(self.beta2, t), out=scratch).sqrt_().add_(self.eps)
        return unrotate(rotated.div_(scratch), a, g, scratch)

    def _first_moment(self, state: dict[str, Tensor], grad: Tensor, finite: Tensor, t: Tensor) -> Tensor:
        """``m ← β₁ m + (1 − β₁) ∇`` (in the parameters' coordinates, kept as is where ``finite`` is
        False) and the bias-corrected ``m / (1 − β₁ᵗ)`` in a fresh tensor."""
        if "m" not in state or state["m"].shape != grad.shape:
            state["m"] = torch.zeros_like(grad)
        m = state["m"]
        torch.where(finite, torch.mul(m, self.beta1).add_(grad, alpha=1.0 - self.beta1), m, out=m)
        return torch.div(m, 1.0 - torch.pow(self.beta1, t))

    def _moments(self, state: dict[str, Tensor], rotated: Tensor) -> tuple[Tensor, Tensor]:
        """The block's ``v`` (shaped as ``rotated``; resized keeping its trailing entries when the
        basis changed its column count) and ``t``, created at 0 on its first step."""
        if "t" not in state:  # the block's first preconditioned step
            state["t"] = torch.zeros((), dtype=rotated.dtype, device=rotated.device)
        held = state.get("v")
        if held is None or held.shape != rotated.shape:
            v = torch.zeros_like(rotated)
            if held is not None:
                rows, columns = min(held.shape[-2], v.shape[-2]), min(held.shape[-1], v.shape[-1])
                v[..., v.shape[-2] - rows :, v.shape[-1] - columns :] = held[..., held.shape[-2] - rows :,
                                                                             held.shape[-1] - columns :]
            state["v"] = v
        return state["v"], state["t"]

    def _thin_precondition(self, grad: Tensor, a: FactorView, g: FactorView, state: dict[str, Tensor]) -> Tensor:
        """The update of a pair with a thin side (the class docstring's second formula)."""
        rotated = _thin_rotate(grad, a, g)
        v, t = self._moments(state, rotated)
        outside = grad - _thin_unrotate(rotated, a, g)
        if "w" not in state or state["w"].shape != grad.shape:
            state["w"] = torch.zeros_like(grad)
        w = state["w"]
        finite = (torch.mul(rotated, 0.0).sum() + torch.mul(outside, 0.0).sum()).eq(0)
        t.add_(finite.to(t.dtype))
        correction = 1.0 - torch.pow(self.beta2, t)
        for moment, part in ((v, rotated), (w, outside)):
            updated = torch.mul(moment, self.beta2).addcmul_(part, part, value=1.0 - self.beta2)
            torch.where(finite, updated, moment, out=moment)
        if self.beta1 is not None:  # Adam's m̂ split as ∇ is, in place of R and O above the roots
            first = self._first_moment(state, grad, finite, t)
            rotated = _thin_rotate(first, a, g)
            outside = first.sub_(_thin_unrotate(rotated, a, g))
        for moment, part in ((v, rotated), (w, outside)):
            part.div_(torch.div(moment, correction).sqrt_().add_(self.eps))
        return _thin_unrotate(rotated, a, g).add_(outside)



def _thin_side(factor: FactorView) -> bool:
    """Whether ``factor``'s held basis is thin (``Q (n, r)``, ``r < n``): a capped factor's."""
    decomposition = factor.decomposition
    return isinstance(decomposition, linalg.Eigen) and decomposition.Q.shape[-1] < decomposition.Q.shape[-2]


def _thin_rotate(grad: Tensor, a: FactorView, g: FactorView) -> Tensor:
    """``Q_Gᵀ ∇ Q_A`` for a pair of dense ungrouped factors with bases ``Q (n, r)`` (full or thin)."""
    return torch.linalg.multi_dot([g.decomposition.Q.T, grad, a.decomposition.Q])


def _thin_unrotate(rotated: Tensor, a: FactorView, g: FactorView) -> Tensor:
    """``Q_G R Q_Aᵀ``: back from :func:`_thin_rotate`'s coordinates (the projection of ∇ for ``R`` its rotation)."""
    return torch.linalg.multi_dot([g.decomposition.Q, rotated, a.decomposition.Q.T])
