"""A warm-started eigenbasis refresh: one step of orthogonal (power) iteration from the held basis.

Owns :class:`PowerRefreshDecomposer`, the ``EigenDecomposer`` that :class:`~kfac_optim.methods.EigenAdam`
holds with ``refresh="power"``, and :func:`power_refresh`, its arithmetic. SOAP's refresh (Vyas et
al. 2024, Algorithm 4; heavyball's ``get_orthogonal_matrix_QR``): with ``F`` the running factor and
``Q`` the basis held, ``Q ← QR((F + μI)·Q)``, the columns taken in the order of their estimated
eigenvalues ``diag(Qᵀ F Q)``, largest first, so that orthogonal iteration's fixed point is the
eigenbasis in that order. One ``(n, n) @ (n, c)`` product and one QR, against ``eigh``'s O(n³) at a
larger constant (docs/tuning.md "EigenAdam's basis refresh").

**Slots stay put.** The orthonormalized columns are written back to the slots they came from
(heavyball's choice): slot ``j`` keeps tracking the eigenvector it held, whatever the order of the
estimated eigenvalues, so the second moment ``v`` a method keeps per slot (EigenAdam's, shaped as
the rotated gradient) stays aligned with its basis without being permuted (the SOAP paper keeps the
columns sorted and permutes ``v`` instead: the same update up to a common permutation of ``Q``'s
columns and ``v``'s entries). The signs are fixed so that ``Rᵀ``'s diagonal is positive: a column
moves continuously from one refresh to the next. ``d`` holds the estimated eigenvalues (the
Rayleigh quotients of the basis before the step, clamped at 0) in the slots' order, not
ascending as ``eigh``'s (EigenAdam does not read them).

**When it falls back to the full decomposition** (``EigenDecomposer``'s): a factor with no held
basis (the first decomposition; a restore that held none, as from DCP, which then orders the slots
as ``eigh`` does), a held basis of another layout (a thin one whose column count is still growing,
a full one where the cap now applies, or the reverse), a diagonal factor, and a refresh that is not
finite (``eigh``'s float64 retry then decides; a non-finite factor fails it, and the caller keeps
the last good decomposition and warns). Capped factors (``max_rank`` columns held) refresh their
thin basis the same way (subspace iteration, O(n²·max_rank)), with the complement ``σ`` recomputed
as ``EigenDecomposer``'s (the mean of the other eigenvalues of the nonzero block).

Deterministic: no random numbers, and the same held basis and factor give the same result (a
checkpoint holds the basis, so a resumed run refreshes from the same one).
Must not know: the method's state, modules, ranks, schedules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kfac_optim import linalg
from kfac_optim.decompositions import Decomposition, EigenDecomposer, FactorView

LIFT_SCALE = 64
"""``μ`` of :func:`lift`: ``LIFT_SCALE·n·eps`` of the factor's dtype times the largest estimated eigenvalue."""
LIFT_CAP = 0.125
"""The most :func:`lift` adds, relative to the largest estimated eigenvalue (coarse dtypes)."""


def lift(dim: int, dtype: torch.dtype) -> float:
    """``μ / max |diag(Qᵀ F Q)|`` of :func:`power_refresh`: ``min(LIFT_SCALE·dim·eps(dtype), LIFT_CAP)``.
    A rank-deficient ``F`` maps its null-space columns to rounding noise, which QR would turn into
    arbitrary directions; ``F + μI`` keeps them near the columns held (heavyball's lift, without its
    1e-8 floor, which only binds for float64 factors of fewer than 2·10⁴ rows)."""
    return min(LIFT_SCALE * dim * torch.finfo(dtype).eps, LIFT_CAP)


def power_refresh(factor: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """One step of orthogonal iteration on a symmetric PSD ``factor (..., n, n)`` from an orthonormal
    ``basis (..., n, c)`` (``c ≤ n``), in ``factor``'s dtype.

    With ``e = diag(basisᵀ factor basis) (..., c)``, ``μ = lift(n)·max |e|`` and the columns' order
    ``π`` sorting ``e`` descending (stably): ``Q̃ R = QR((factor + μI)·basis[:, π])`` with ``R``'s
    diagonal made non-negative (``Q̃``'s columns negated where it is negative), and ``Q[:, π] = Q̃``.
    Returns ``Q (..., n, c)`` and ``e`` clamped at 0 (module docstring: slots, signs).
    """
    basis = basis.to(factor.dtype)
    product = factor @ basis
    estimated = (basis * product).sum(-2)
    magnitude = estimated.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(factor.dtype).tiny)
    product.add_(basis * (lift(factor.shape[-1], factor.dtype) * magnitude).unsqueeze(-2))
    order = torch.argsort(estimated, dim=-1, descending=True, stable=True).unsqueeze(-2).expand_as(product)
    orthogonal, triangular = torch.linalg.qr(product.gather(-1, order))
    signs = triangular.diagonal(dim1=-2, dim2=-1).sign()
    orthogonal.mul_(torch.where(signs == 0, torch.ones_like(signs), signs).unsqueeze(-2))
    return product.scatter_(-1, order, orthogonal), estimated.clamp(min=0)


@dataclass(frozen=True)
class PowerRefreshDecomposer(EigenDecomposer):
    """An :class:`~kfac_optim.decompositions.EigenDecomposer` whose refreshes are :func:`power_refresh`
    steps from the basis held (module docstring); the first decomposition, and every one it falls
    back on, is ``EigenDecomposer``'s. Travels, is saved and sized as ``EigenDecomposer``'s."""

    def decompose(
        self, factor: FactorView, shift: float, dtype: torch.dtype, drop_below: float | None = None
    ) -> Decomposition | None:
        held = factor.decomposition
        if not self._refreshes(factor, held, drop_below):
            return super().decompose(factor, shift, dtype, drop_below)
        Q, d = power_refresh(factor.running, held.Q)
        complement = None
        if Q.shape[-1] < factor.dim:  # the cap's thin basis: σ, the mean of the rest over the nonzero block
            running = factor.running
            nonzero = (running.diagonal() > 0).sum()
            complement = ((running.trace() - d.sum()) / (nonzero - Q.shape[-1]).clamp(min=1)).clamp(min=0)
            complement = complement.reshape(1).to(dtype)
        if not bool(torch.isfinite(Q.sum() + d.sum())):
            return super().decompose(factor, shift, dtype, drop_below)
        return linalg.Eigen(Q=Q.to(dtype).contiguous(), d=d.to(dtype), complement=complement)

    def _refreshes(self, factor: FactorView, held: Decomposition | None, drop_below: float | None) -> bool:
        """Whether ``held`` has the layout a full decomposition of ``factor`` would hold now: full
        ``(..., n, n)``, or ``(n, max_rank)`` where the cap truncates (capped, with ``drop_below``)."""
        if factor.diagonal or not isinstance(held, linalg.Eigen):
            return False
        columns = self.max_rank if self.capped(factor) and drop_below is not None else factor.dim
        return tuple(held.Q.shape) == (*factor.batch_shape, factor.dim, columns)
