"""A warm-started eigenbasis refresh: one step of orthogonal (power) iteration from the held basis.

Owns :class:`PowerRefreshDecomposer`, the ``EigenDecomposer`` that :class:`~kfac_optim.methods.EigenAdam`
holds with ``refresh="power"``, and :func:`power_refresh`, its arithmetic: SOAP's refresh (Vyas et
al. 2024, Algorithm 4), ``Q ← QR((F + μI)·Q)`` from the held basis ``Q`` with ``F`` the running
factor, the columns taken largest estimated eigenvalue ``diag(Qᵀ F Q)`` first. One
``(n, n) @ (n, c)`` product and one QR against ``eigh``'s O(n³).

Slots stay put: each orthonormalized column goes back to the slot it came from, so a method's
per-slot second moment stays aligned without a permutation; signs are fixed so a column moves
continuously between refreshes; ``d`` holds the estimated eigenvalues in the slots' order.
It falls back to ``EigenDecomposer``'s full decomposition where no basis of the same layout is
held (the first decomposition, a DCP restore, a cap that now applies), for diagonal factors and
for a non-finite refresh. Deterministic: the same held basis and factor give the same result.
The details and the costs: docs/numerics.md "Eigen-Adam", docs/tuning.md "EigenAdam's basis refresh".
Must not know: the method's state, modules, ranks, schedules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kfac_optim import linalg
from kfac_optim.methods.decompositions import Decomposition, EigenDecomposer, FactorView

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
    """An :class:`~kfac_optim.methods.decompositions.EigenDecomposer` whose refreshes are :func:`power_refresh`
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
