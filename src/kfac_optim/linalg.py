"""Damped eigen/inverse math for symmetric positive semi-definite Kronecker factors.

Owns: the eigendecomposition and inverse of one factor (rank-deficient ones included: zero rows
deflated, low rank through the range, a float64 retry), the choice of its numerical rank, the
damped Kronecker solves of docs/numerics.md (full or thin), and packing a symmetric matrix to
its upper triangle.
Must not know: layers, modules, ranks or optimizer state.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Eigen:
    """``F = Q diag(d) Qᵀ + σ (I − Q Qᵀ)`` with eigenvalues clamped at 0, ascending. ``Q: (n, r)``,
    ``d: (r,)``, ``complement``: ``σ`` as a ``(1,)`` tensor, or None for ``σ = 0``.

    Full (``r = n``) or thin (``r < n``): a thin one keeps only the leading eigenpairs and the
    complement of ``Q``'s columns counts as eigenvalue 0 (see :func:`symmetric_eigen`), or as the
    isotropic ``σ ≥ 0`` of a factor truncated at a rank cap (its discarded eigenvalues' mean; see
    :func:`symmetric_eigen`'s ``max_rank``). Under a cap, ``complement`` is set exactly when ``Q``
    has ``max_rank`` columns (``σ = 0`` when the factor's rank is exactly ``max_rank``), so a
    receiver of ``Q`` knows from its shape whether ``σ`` comes with it.
    """

    Q: Tensor
    d: Tensor
    complement: Tensor | None = None
    derived: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """Tensors computed from this decomposition (and a partner's) that the solves reuse while it is
    held, by name (:func:`complement_weights`); never saved or shipped: a decomposition received,
    loaded or refreshed is a new ``Eigen`` that starts without any."""

    @property
    def thin(self) -> bool:
        return self.Q.shape[1] < self.Q.shape[0]


# Rank selection (docs/numerics.md, the eigen method). Preconditioning weighs the eigenpair (i, j) of
# G ⊗ A by 1/(d_G,i·d_A,j + λ); a dropped eigenvalue counts as 0, i.e. its weight becomes 1/λ,
# a relative change of d_G,i·d_A,j/(d_G,i·d_A,j + λ) ≤ d_A,j·tr(G)/λ. Dropping the eigenvalues of
# A at or below RANK_RTOL·λ/tr(G) (and of G at or below RANK_RTOL·λ/tr(A)) therefore changes every
# weight by a relative RANK_RTOL at most, at the damping of the decomposition step; eigenvalues
# at the factor's rounding floor (RANK_NOISE_EPS·n·eps·max d, as ``torch.linalg.matrix_rank``)
# are dropped too. A factor is held thin only when that at least halves Q (THIN_MAX_FRACTION):
# the thin solve costs ~2·out·in·r per side against ~2·out·in·n, plus one pass over the gradient.
RANK_RTOL = 1e-6
RANK_NOISE_EPS = 1.0
THIN_MAX_FRACTION = 0.5
# Extra random directions when decomposing a factor of known low rank through its range, or
# the leading eigenpairs of a truncated one; and the truncated one's power iterations (Halko,
# Martinsson & Tropp 2011, §4.5: two sharpen the leading subspace enough for a K-FAC factor's
# decaying spectrum).
LOW_RANK_OVERSAMPLE = 8
POWER_ITERATIONS = 2


def rank_threshold(damping: float, other_trace: float) -> float:
    """Eigenvalues of one factor at or below which the eigen solve may treat them as 0 (see
    ``RANK_RTOL``): ``RANK_RTOL·λ/tr(other factor)``; infinite when the other factor is 0."""
    if other_trace <= 0:
        return float("inf")
    return RANK_RTOL * damping / other_trace


def _all_finite(*tensors: Tensor) -> bool:
    # A nan/inf entry makes the sum non-finite; ``isfinite(t).all()`` costs ~100× more on CPU.
    return all(bool(torch.isfinite(t.sum())) for t in tensors)


def _eigh(matrix: Tensor) -> tuple[Tensor, Tensor] | None:
    """``torch.linalg.eigh`` in ``matrix``'s precision, then float64; None when both fail."""
    for work_dtype in dict.fromkeys((matrix.dtype, torch.float64)):
        try:
            d, Q = torch.linalg.eigh(matrix.to(work_dtype))
        except RuntimeError as error:  # torch.linalg.LinAlgError subclasses RuntimeError
            logger.debug("eigh of a %s factor failed in %s: %s", tuple(matrix.shape), work_dtype, error)
            continue
        if _all_finite(d, Q):
            return d, Q
        logger.debug("eigh of a %s factor returned non-finite values in %s", tuple(matrix.shape), work_dtype)
    return None


def _low_rank_eigh(matrix: Tensor, columns: int) -> tuple[Tensor, Tensor] | None:
    """Eigenpairs ``d (c,)``, ``Q (k, c)`` of a PSD ``matrix (k, k)`` of rank below ``c = columns``.

    The range of ``matrix·Ω`` for a Gaussian ``Ω (k, c)`` is the matrix's range (with probability
    1, rank < c), so with ``B`` its orthonormal basis, ``matrix = B (Bᵀ matrix B) Bᵀ`` and the
    ``c x c`` eigenproblem gives the eigenpairs: O(k²c) instead of O(k³) (Halko et al. 2011, with
    no truncation). ``Ω`` comes from a generator seeded with ``k`` (reproducible; the global RNG
    is not touched).
    """
    return _range_eigh(matrix, columns, power_iterations=0)


def _top_eigh(matrix: Tensor, rank: int) -> tuple[Tensor, Tensor] | None:
    """The ``rank`` leading eigenpairs ``d (rank,)``, ``Q (k, rank)`` of a PSD ``matrix (k, k)``,
    approximately: a randomized range finder with ``LOW_RANK_OVERSAMPLE`` extra directions and
    ``POWER_ITERATIONS`` power iterations, then Rayleigh–Ritz on the basis (Halko et al. 2011,
    Algorithms 4.4 and 5.3). O(k²·rank) instead of ``eigh``'s O(k³). Seeded as :func:`_low_rank_eigh`.
    """
    result = _range_eigh(matrix, min(rank + LOW_RANK_OVERSAMPLE, len(matrix)), POWER_ITERATIONS)
    if result is None:
        return None
    d, Q = result
    return d[-rank:], Q[:, -rank:]


def _range_eigh(matrix: Tensor, columns: int, power_iterations: int) -> tuple[Tensor, Tensor] | None:
    """Rayleigh–Ritz on a randomized range basis ``B (k, c)`` of a PSD ``matrix (k, k)``: the eigenpairs
    ``d (c,)``, ``B U (k, c)`` of ``Bᵀ matrix B`` (ascending). ``B`` spans ``matrix·Ω`` for a Gaussian
    ``Ω (k, c)`` from a generator seeded with ``k`` (reproducible; the global RNG is not touched),
    refined by ``power_iterations`` products with ``matrix`` (Halko et al. 2011, Algorithms 4.3-4.4)."""
    generator = torch.Generator(device=matrix.device).manual_seed(len(matrix))
    omega = torch.randn(len(matrix), columns, generator=generator, dtype=matrix.dtype, device=matrix.device)
    basis, _ = torch.linalg.qr(matrix @ omega)
    for _ in range(power_iterations):
        basis, _ = torch.linalg.qr(matrix @ basis)
    small = basis.T @ matrix @ basis
    result = _eigh((small + small.T) / 2)
    if result is None:
        return None
    d, U = result
    return d, basis.to(U.dtype) @ U


def symmetric_eigen(
    factor: Tensor, dtype: torch.dtype, drop_below: float | None = None, rank_bound: int | None = None,
    max_rank: int | None = None,
) -> Eigen | None:
    """Eigendecomposition of a symmetric PSD factor ``(n, n)`` (or a batch ``(k, n, n)``, decomposed
    whole and full: the options below apply to one matrix), returned in ``dtype``.

    Structure first: a PSD matrix's zero diagonal entries have zero rows and columns (e.g. the
    zero-padding taps of a convolution over feature maps smaller than its kernel: 4096 of the
    4608 input columns of a 3x3 conv on 1x1 maps), so only the ``k x k`` block of the nonzero
    diagonal is decomposed; the rest are exact eigenvalues 0. This also avoids ``eigh`` (LAPACK
    syevd) failing to converge on a matrix with thousands of repeated zero eigenvalues.

    ``drop_below`` (e.g. :func:`rank_threshold`): eigenvalues at or below it, and those at the
    factor's rounding floor, count as 0, and the result is thin (only the ``r`` leading
    eigenpairs) when ``r ≤ THIN_MAX_FRACTION·n``. ``None``: full, every eigenvalue kept.

    ``rank_bound``: an upper bound of the factor's rank (a Gram matrix of that many rows, e.g.
    after the first batches). With ``drop_below`` and a bound well below the block's size
    (``rank_bound + LOW_RANK_OVERSAMPLE ≤ THIN_MAX_FRACTION·k``), the block is decomposed
    through its range (:func:`_low_rank_eigh`: O(k²·rank) instead of O(k³), and no ``k``-fold
    repeated zero eigenvalue for LAPACK to trip on).

    ``max_rank``: a cap on the eigenbasis of a factor wider than it (``n > max_rank``), applied
    with ``drop_below`` (the thin solve; without it the result is full, as uncapped). When the
    factor's rank may exceed the cap (no ``rank_bound`` ≤ ``max_rank``, and more than ``max_rank``
    nonzero rows), only the ``max_rank`` leading eigenpairs are computed (:func:`_top_eigh`) and
    kept, and the rest of the spectrum becomes one isotropic eigenvalue ``σ`` (``complement``):
    the mean of the discarded eigenvalues of the nonzero block, ``(tr F − Σ kept)/(k − max_rank)``
    (0 would over-step along real curvature). The zero rows' exact eigenvalues 0 are not averaged
    in: their gradient columns are 0 too, so ``σ`` does not act on them. Otherwise (rank within
    the cap) the result is the exact thin one, held thin whatever its rank (``σ = 0`` attached
    when it has exactly ``max_rank`` columns; see :class:`Eigen`).

    Tries ``factor``'s own precision first, then float64 if ``eigh`` raises or returns
    non-finite values (details at DEBUG on this module's logger). Returns ``None`` when both
    fail (the caller keeps what it holds).

    Decompositions are returned row-major (LAPACK writes ``eigh``'s Q and ``cholesky_inverse``'s
    result column-major). A rank that receives one holds it row-major, and the same matrix in the
    other layout takes another BLAS path that rounds differently, which would let DDP ranks drift.
    """
    if factor.dim() == 3:
        batched = _eigh(factor)
        if batched is None:
            return None
        return Eigen(Q=batched[1].to(dtype).contiguous(), d=batched[0].clamp(min=0).to(dtype))
    n = len(factor)
    capped = max_rank is not None and n > max_rank
    active = torch.nonzero(factor.diagonal() > 0).squeeze(1)  # one host sync per factor
    k = len(active)
    truncating = False
    if k:
        block = factor if k == n else factor[active][:, active]
        columns = None if rank_bound is None else rank_bound + LOW_RANK_OVERSAMPLE
        truncating = (capped and drop_below is not None and k > max_rank
                      and (rank_bound is None or rank_bound > max_rank))
        if truncating:
            result = _top_eigh(block, max_rank)
        elif drop_below is not None and columns is not None and columns <= THIN_MAX_FRACTION * k:
            result = _low_rank_eigh(block, columns)
        else:
            result = _eigh(block)
        if result is None:
            return None
        d, Q = result
        d = d.clamp(min=0)
    else:  # a zero factor
        d, Q = factor.new_zeros(0), factor.new_zeros(0, 0)
    if drop_below is not None:
        floor = RANK_NOISE_EPS * n * torch.finfo(factor.dtype).eps * float(d[-1]) if k else 0.0
        r = len(d) if truncating else int((d > max(drop_below, floor)).sum())
        if r <= THIN_MAX_FRACTION * n or capped:
            thin = Q.new_zeros(n, r)
            thin[active] = Q[:, len(d) - r :]
            kept = d[len(d) - r :]
            complement = None
            if truncating:  # the discarded eigenvalues' mean, over the nonzero block
                complement = ((torch.trace(block) - kept.sum()) / (k - r)).clamp(min=0).reshape(1).to(dtype)
            elif capped and r == max_rank:
                complement = kept.new_zeros(1, dtype=dtype)
            return Eigen(Q=thin.to(dtype), d=kept.to(dtype).contiguous(), complement=complement)
    if k < n:  # the zero rows' unit vectors first: eigenvalue 0 sorts first
        inactive = torch.nonzero(factor.diagonal() <= 0).squeeze(1)
        full = Q.new_zeros(n, n)
        full[inactive, torch.arange(n - k, device=Q.device)] = 1
        full[active, n - k :] = Q
        Q, d = full, torch.cat([d.new_zeros(n - k), d])
    return Eigen(Q=Q.to(dtype).contiguous(), d=d.to(dtype))


def damped_inverse(factor: Tensor, shift: float, dtype: torch.dtype) -> Tensor | None:
    """``(F + shift·I)⁻¹`` of a symmetric factor ``(n, n)`` (or a batch ``(k, n, n)``) via Cholesky, in ``dtype``.

    Retries in float64 like :func:`symmetric_eigen`; ``None`` when both attempts fail. Row-major
    (see :func:`symmetric_eigen`).
    """
    for work_dtype in dict.fromkeys((factor.dtype, torch.float64)):
        shifted = factor.to(work_dtype)
        shifted = shifted + shift * torch.eye(shifted.shape[-1], dtype=work_dtype, device=shifted.device)
        cholesky, info = torch.linalg.cholesky_ex(shifted)
        if bool(info.any()):
            continue
        inverse = torch.cholesky_inverse(cholesky)
        if _all_finite(inverse):
            return inverse.to(dtype).contiguous()
    return None


def eigen_precondition(grad: Tensor, eig_a: Eigen, eig_g: Eigen, damping: float) -> Tensor:
    """``(G ⊗ A + λI)⁻¹ vec(∇W)`` for ``grad: (out, in)``, ``A: (in, in)``, ``G: (out, out)``.

    Full: ``V = Q_G [(Q_Gᵀ ∇W Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ``, the exact damped Kronecker inverse.
    Thin (either side): the complement of the kept eigenvectors gets ``1/λ``,
    ``V = ∇W/λ + Q_G [(Q_Gᵀ ∇W Q_A) ⊙ (1/(d_G d_Aᵀ + λ) − 1/λ)] Q_Aᵀ``, exact when the dropped
    eigenvalues are 0, at O(out·in·r) instead of O(out·in·n) per thin side.
    With an isotropic complement on either side (:attr:`Eigen.complement`): :func:`complement_precondition`.
    """
    if eig_a.complement is not None or eig_g.complement is not None:
        return complement_precondition(grad, eig_a, eig_g, damping)
    if not (eig_a.thin or eig_g.thin):
        # Three tensors shaped as ∇W (``scratch``, ``rotated``, the result), the same products as
        # ``Q_G (Q_Gᵀ ∇W Q_A / ...) Q_Aᵀ`` without other temporaries: fresh CPU pages cost more than the
        # elementwise work on them.
        scratch = eig_g.Q.T @ grad
        rotated = scratch @ eig_a.Q
        rotated /= torch.outer(eig_g.d, eig_a.d, out=scratch).add_(damping)
        return torch.matmul(eig_g.Q, rotated, out=scratch) @ eig_a.Q.T
    rotated = torch.linalg.multi_dot([eig_g.Q.T, grad, eig_a.Q])
    # 1/(x + λ) − 1/λ = −x / (λ(x + λ)), without the cancellation.
    products = torch.outer(eig_g.d, eig_a.d)
    rotated *= products.div_(products.add(damping).mul_(-damping))
    return torch.linalg.multi_dot([eig_g.Q, rotated, eig_a.Q.T]).add_(grad, alpha=1.0 / damping)


def complement_precondition(grad: Tensor, eig_a: Eigen, eig_g: Eigen, damping: float) -> Tensor:
    """``(Ĝ ⊗ Â + λI)⁻¹ vec(∇W)`` for ``Â = Q_A diag(d_A) Q_Aᵀ + σ_A (I − Q_A Q_Aᵀ)`` and ``Ĝ``
    likewise (:class:`Eigen`; ``σ = 0`` where ``complement`` is None), at O(out·in·(r_A + r_G)).

    With ``P = I − Q Qᵀ`` per side, ``∇W`` splits into four parts, each an eigenspace pair of
    ``Ĝ ⊗ Â``: ``Q_G·Q_A`` (weights ``1/(d_G d_Aᵀ + λ)``), ``Q_G·P_A`` (``w_G = 1/(d_G σ_A + λ)``),
    ``P_G·Q_A`` (``w_A = 1/(σ_G d_A + λ)``) and ``P_G·P_A`` (``c = 1/(σ_G σ_A + λ)``). Expanding the
    projections, with ``L = Q_Gᵀ ∇W``, ``M = ∇W Q_A`` and ``R = Q_Gᵀ M``::

        V = c ∇W + (Q_G [R ⊙ (1/(d_G d_Aᵀ + λ) − w_G − w_Aᵀ + c)] + M diag(w_A − c)) Q_Aᵀ
              + Q_G diag(w_G − c) L

    The last term vanishes when ``σ_A`` is 0 by structure (``complement`` None: ``w_G = c``) and
    is then not computed; with both ``σ`` 0 this is :func:`eigen_precondition`'s thin formula.
    """
    weights = complement_weights(eig_a, eig_g, damping)
    m = grad @ eig_a.Q
    rotated = (eig_g.Q.T @ m).mul_(weights.core)
    left = torch.addcmul(eig_g.Q @ rotated, m, weights.a)
    direction = torch.addmm(grad * weights.c, left, eig_a.Q.T)
    if weights.g is not None:
        l_part = (eig_g.Q.T @ grad).mul_(weights.g)
        direction.addmm_(eig_g.Q, l_part)
    return direction


@dataclass(frozen=True)
class ComplementWeights:
    """What :func:`complement_precondition` computes from the pair's eigenvalues and ``λ`` alone:
    ``c (1,)``; ``core (r_G, r_A)``, ``1/(d_G d_Aᵀ + λ) − w_G − w_Aᵀ + c``; ``a = w_A − c`` as
    ``(1, r_A)``; ``g = w_G − c`` as ``(r_G, 1)``, or None when ``σ_A`` is 0 by structure."""

    c: Tensor
    core: Tensor
    a: Tensor
    g: Tensor | None


def complement_weights(eig_a: Eigen, eig_g: Eigen, damping: float) -> ComplementWeights:
    """:class:`ComplementWeights` of the pair at ``damping``, computed once for as long as both
    decompositions are held and the damping is the same: kept in ``eig_a.derived`` with a weak
    reference to the ``eig_g`` they were computed with (the same tensors, and so the same bits, as
    computing them at every step)."""
    held = eig_a.derived.get("complement")
    if held is not None and held[0]() is eig_g and not isinstance(damping, Tensor) and held[1] == damping:
        return held[2]
    zero = eig_a.d.new_zeros(1)
    sigma_a = zero if eig_a.complement is None else eig_a.complement
    sigma_g = zero if eig_g.complement is None else eig_g.complement
    c = (sigma_g * sigma_a).add_(damping).reciprocal_()
    w_g = (eig_g.d * sigma_a).add_(damping).reciprocal_()
    w_a = (eig_a.d * sigma_g).add_(damping).reciprocal_()
    core = torch.outer(eig_g.d, eig_a.d).add_(damping).reciprocal_()
    core.sub_(w_g.unsqueeze(1)).sub_(w_a.unsqueeze(0)).add_(c)
    weights = ComplementWeights(c=c, core=core, a=w_a.sub(c).unsqueeze(0),
                                g=None if eig_a.complement is None else w_g.sub(c).unsqueeze(1))
    eig_a.derived["complement"] = (weakref.ref(eig_g), damping, weights)
    return weights


def inverse_precondition(grad: Tensor, a_inverse: Tensor, g_inverse: Tensor) -> Tensor:
    """``V = (G + (√λ/π) I)⁻¹ ∇W (A + π√λ I)⁻¹`` from precomputed damped inverses."""
    return g_inverse @ grad @ a_inverse


# Blocked symmetric Gram: the upper block rows only, then the strictly lower blocks copied from
# the upper ones. Saves ~35% of the multiply-adds at 4 blocks but the transposed copies cost
# ~n²/3 strided writes, so it pays only with enough rows per column (measured on CPU:
# benchmarks/step_time.py; break-even near 150 rows).
GRAM_BLOCKS = 4
GRAM_MIN_ROWS = 256
GRAM_MIN_DIM = 128


MIRROR_TILE = 256


def mirror_upper_(
    matrix: Tensor, spans: list[tuple[int, int]] | None = None, diagonal_tiles: bool = True
) -> Tensor:
    """Copy the upper triangle of a square ``matrix (..., n, n)`` onto its lower triangle, in place
    (each of a batch's matrices): the result equals its transpose exactly, whatever rounding made
    the two triangles differ.

    Tile by tile over the index ``spans`` (default: ``MIRROR_TILE`` wide; small transposed copies
    stay in cache, and one whole-matrix transposed copy is ~4× slower than a plain one on CPU).
    A tile of at most ``MIRROR_TILE²`` entries is first copied out whole (contiguous rows), so its
    transposed read is from a buffer in cache: ~25% less time than reading it strided from the
    matrix (measured at n = 2048 and 4096); larger tiles (e.g. :func:`add_gram_`'s blocks) are
    read in place. ``diagonal_tiles=False`` leaves the diagonal tiles as they are, for callers that
    computed those tiles whole. The diagonal tiles' entries come out plus 0.0 (a -0.0 there becomes
    +0.0; a factor holds none), the others as copied.
    """
    n = matrix.shape[-1]
    if spans is None:
        spans = _spans([*range(0, n, MIRROR_TILE), n])
    for j, (lo, hi) in enumerate(spans):
        if diagonal_tiles:
            tile = matrix[..., lo:hi, lo:hi]
            # The upper entry at every position, plus 0.0: the same bits as ``triu + triu(1)ᵀ``
            # (x + 0.0 is x, but +0.0 for -0.0), with one temporary instead of three.
            tile.copy_(torch.where(_strictly_lower(hi - lo, tile.device), tile.mT, tile).add_(0.0))
        for lo2, hi2 in spans[j + 1 :]:
            upper = matrix[..., lo:hi, lo2:hi2]
            if (hi - lo) * (hi2 - lo2) <= MIRROR_TILE**2:
                upper = upper.clone()
            matrix[..., lo2:hi2, lo:hi].copy_(upper.mT)
    return matrix


@functools.lru_cache(maxsize=16)
def _strictly_lower(n: int, device: torch.device) -> Tensor:
    """The ``(n, n)`` bool mask of the entries below the diagonal, on ``device`` (made once per size)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_(-1)


def _spans(edges: list[int]) -> list[tuple[int, int]]:
    """Consecutive ``(lo, hi)`` index ranges between ``edges``."""
    return list(zip(edges[:-1], edges[1:]))


def add_gram_(out: Tensor, rows: Tensor) -> Tensor:
    """``out += rowsᵀ rows`` for ``rows: (R, n)`` into ``out: (n, n)`` (may be a strided view).

    Large products compute only the upper triangle's blocks and mirror them (see ``GRAM_BLOCKS``),
    which also makes the result exactly symmetric; small ones are one ``addmm_``.
    """
    count, n = rows.shape
    if count < GRAM_MIN_ROWS or n < GRAM_MIN_DIM:
        return out.addmm_(rows.T, rows)
    spans = _spans([n * j // GRAM_BLOCKS for j in range(GRAM_BLOCKS + 1)])
    for lo, hi in spans:
        out[lo:hi, lo:].addmm_(rows[:, lo:hi].T, rows[:, lo:])
    return mirror_upper_(out, spans, diagonal_tiles=False)


def add_column_gram_(out: Tensor, columns: Tensor) -> Tensor:
    """``out += Σ_b columns[b] columns[b]ᵀ`` for ``columns: (B, n, L)``: the Gram of the B·L rows
    ``columns[b, :, l]`` without first copying them into a contiguous ``(B·L, n)`` (e.g. conv patches
    as ``F.unfold`` returns them). Blocked and mirrored like :func:`add_gram_`.
    """
    batch, n, length = columns.shape
    if batch * length < GRAM_MIN_ROWS or n < GRAM_MIN_DIM:
        return out.addbmm_(columns, columns.transpose(1, 2))
    spans = _spans([n * j // GRAM_BLOCKS for j in range(GRAM_BLOCKS + 1)])
    for lo, hi in spans:
        out[lo:hi, lo:].addbmm_(columns[:, lo:hi], columns[:, lo:].transpose(1, 2))
    return mirror_upper_(out, spans, diagonal_tiles=False)


def triu_size(n: int) -> int:
    """Number of entries in the upper triangle (diagonal included) of an ``(n, n)`` matrix."""
    return n * (n + 1) // 2


def pack_symmetric(matrix: Tensor, out: Tensor | None = None) -> Tensor:
    """The upper triangle of a symmetric ``(n, n)`` matrix as a flat ``(n(n+1)/2,)`` (into ``out``).

    Index-free layout (after LAPACK's rectangular full packed format), built from slices so that
    packing and unpacking cost a few copies of the matrix, not a gather with index tensors. With
    ``k = n // 2`` and the leading ``2k × 2k`` part split into ``k × k`` blocks
    ``[[A, B], [Bᵀ, C]]``, the result is, back to back:

    - a ``(k + 1, k)`` block ``X`` with ``triu(A)`` in ``X[:k]`` (on and above the diagonal) and
      ``tril(C)`` in ``X[1:]`` (on and below its diagonal, i.e. strictly below ``X``'s);
    - ``B``, ``(k, k)`` row-major;
    - for odd ``n``, the last column ``matrix[:, n - 1]``.
    """
    n = len(matrix)
    k = n // 2
    if out is None:
        out = matrix.new_empty(triu_size(n))
    folded, off_diagonal, last = _packed_parts(out, n)
    torch.triu(matrix[:k, :k], out=folded[:k])
    folded[k].zero_()
    folded[1:].add_(matrix[k : 2 * k, k : 2 * k].tril())
    off_diagonal.copy_(matrix[:k, k : 2 * k])
    if last is not None:
        last.copy_(matrix[:, n - 1])
    return out


def unpack_symmetric(packed: Tensor, n: int, out: Tensor | None = None) -> Tensor:
    """Inverse of :func:`pack_symmetric`: the full symmetric ``(n, n)`` matrix (into ``out``)."""
    if out is None:
        out = packed.new_empty(n, n)
    k = n // 2
    folded, off_diagonal, last = _packed_parts(packed, n)
    # Fill the upper triangle (what lands below the diagonal here is overwritten), then mirror.
    out[:k, :k].copy_(folded[:k])
    out[:k, k : 2 * k].copy_(off_diagonal)
    out[k : 2 * k, k : 2 * k].copy_(folded[1:].T)
    if last is not None:
        out[:, n - 1].copy_(last)
    return mirror_upper_(out)


def _packed_parts(packed: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """Views of :func:`pack_symmetric`'s layout: ``X (k+1, k)``, ``B (k, k)``, last column or None."""
    k = n // 2
    folded_size = (k + 1) * k
    folded = packed[:folded_size].view(k + 1, k)
    off_diagonal = packed[folded_size : folded_size + k * k].view(k, k)
    last = packed[folded_size + k * k :] if n % 2 else None
    return folded, off_diagonal, last


def nearest_kronecker_sum(x1: Tensor, y1: Tensor, x2: Tensor, y2: Tensor) -> tuple[Tensor, Tensor]:
    """``(x, y)`` with ``diag(x) ⊗ y`` the Kronecker product nearest in Frobenius norm to
    ``diag(x1) ⊗ y1 + diag(x2) ⊗ y2`` (Van Loan & Pitsianis 1993), without a host sync.

    ``x1, x2: (V,)`` non-negative diagonals, ``y1, y2: (D, D)`` symmetric PSD. The rearranged sum is
    the rank-2 matrix ``X Yᵀ`` (``X = [x1 x2]``, ``Y = [vec y1, vec y2]``); its top left singular
    vector is ``X c`` for ``c`` the Perron eigenvector of the 2x2 ``(YᵀY)(XᵀX)`` (non-negative
    entries), so ``x = c1·x1 + c2·x2`` and ``y = ((XᵀX c)_1·y1 + (XᵀX c)_2·y2) / cᵀXᵀXc``:
    non-negative and PSD (returned split so that ``x`` is a weighted mean of ``x1`` and ``x2``). Exact when one term is
    zero or the terms are proportional. O(V + D²). The sum is unchanged by ``x_i → α_i x_i, y_i → y_i / α_i``, and ``c``
    and the weights of ``y`` by scaling ``X`` or ``Y`` whole: so each term is balanced (``x_i``, ``y_i`` of equal
    largest entry) and ``X``, ``Y`` are divided by their largest entries before the 2x2 problem (which would
    otherwise under- or overflow in float32 for terms of very different scales).
    """
    tiny = torch.finfo(x1.dtype).tiny
    balanced, alphas = [], []
    for x, y in ((x1, y1), (x2, y2)):
        x_max, y_max = x.amax(), y.diagonal().amax()  # non-negative x; PSD y: |y_jk| ≤ max_j y_jj
        alpha = torch.where((x_max > 0) & (y_max > 0), y_max.sqrt() / x_max.sqrt().clamp(min=tiny), 1.0)
        balanced += [x * alpha, y / alpha]
        alphas.append(alpha)
    x1, y1, x2, y2 = balanced
    x_scale = torch.maximum(x1.amax(), x2.amax()).clamp(min=tiny)
    y_scale = torch.maximum(y1.diagonal().amax(), y2.diagonal().amax()).clamp(min=tiny)
    x1, x2, y1, y2 = x1 / x_scale, x2 / x_scale, y1 / y_scale, y2 / y_scale
    p = torch.stack([torch.stack([x1.dot(x1), x1.dot(x2)]), torch.stack([x2.dot(x1), x2.dot(x2)])])
    flat1, flat2 = y1.reshape(-1), y2.reshape(-1)
    q12 = flat1.dot(flat2)
    q = torch.stack([torch.stack([flat1.dot(flat1), q12]), torch.stack([q12, flat2.dot(flat2)])])
    k = q @ p
    a, b, c, d = k[0, 0], k[0, 1], k[1, 0], k[1, 1]
    s = torch.sqrt(((a - d) / 2) ** 2 + (b * c).clamp(min=0))
    # (b, λ − a) and (λ − d, c) are eigenvectors of λ = (a + d)/2 + s; each is computed from sums of
    # non-negative terms in its own case (no cancellation); a zero one falls back to the other, then to (1, 1).
    first, second = torch.stack([b, (d - a) / 2 + s]), torch.stack([(a - d) / 2 + s, c])
    vector = torch.where(a >= d, second, first)
    vector = torch.where(vector.sum() > 0, vector, torch.where(a >= d, first, second))
    vector = torch.where(vector.sum() > 0, vector, torch.ones_like(vector))
    vector = vector / vector.sum()
    weights = p @ vector
    norm = vector.dot(weights).clamp(min=tiny)
    # Split the product as x = (c1·α1·x1 + c2·α2·x2) / (c1·α1 + c2·α2) in the caller's units: a
    # weighted mean of x1 and x2 (x1 itself when the second term is zero).
    gamma = vector[0] * alphas[0] + vector[1] * alphas[1]
    x = (vector[0] * x1 + vector[1] * x2) * (x_scale / gamma)
    return x, ((weights[0] / norm) * y1 + (weights[1] / norm) * y2) * (y_scale * gamma)
