"""Damped eigen/inverse math for symmetric positive semi-definite Kronecker factors.

Owns: the eigendecomposition and inverse of one factor (with a float64 retry), the damped
Kronecker solves of docs/design.md §3, and packing a symmetric matrix to its upper triangle.
Must not know: layers, modules, ranks or optimizer state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Eigen:
    """``F = Q diag(d) Qᵀ`` with eigenvalues clamped at 0. ``Q: (n, n)``, ``d: (n,)``."""

    Q: Tensor
    d: Tensor


def nbytes(decomposition: Eigen | Tensor | None) -> int:
    """Bytes held by a decomposition (``Q`` and ``d``, an inverse, or none)."""
    if decomposition is None:
        return 0
    if isinstance(decomposition, Eigen):
        return decomposition.Q.nbytes + decomposition.d.nbytes
    return decomposition.nbytes


def _all_finite(*tensors: Tensor) -> bool:
    # A nan/inf entry makes the sum non-finite; ``isfinite(t).all()`` costs ~100× more on CPU.
    return all(bool(torch.isfinite(t.sum())) for t in tensors)


def symmetric_eigen(factor: Tensor, dtype: torch.dtype) -> Eigen | None:
    """Eigendecomposition of a symmetric factor ``(n, n)``, returned in ``dtype``.

    Tries ``factor``'s own precision first, then float64 if ``eigh`` raises or returns
    non-finite values. Returns ``None`` when both attempts fail (the caller keeps its last good
    decomposition).

    Decompositions are returned row-major (LAPACK writes ``eigh``'s Q and ``cholesky_inverse``'s
    result column-major). A rank that receives one holds it row-major, and the same matrix in the
    other layout takes another BLAS path that rounds differently, which would let DDP ranks drift.
    """
    for work_dtype in dict.fromkeys((factor.dtype, torch.float64)):
        try:
            d, Q = torch.linalg.eigh(factor.to(work_dtype))
        except RuntimeError:  # torch.linalg.LinAlgError subclasses RuntimeError
            continue
        if _all_finite(d, Q):
            return Eigen(Q=Q.to(dtype).contiguous(), d=d.clamp(min=0).to(dtype))
    return None


def damped_inverse(factor: Tensor, shift: float, dtype: torch.dtype) -> Tensor | None:
    """``(F + shift·I)⁻¹`` of a symmetric factor ``(n, n)`` via Cholesky, returned in ``dtype``.

    Retries in float64 like :func:`symmetric_eigen`; ``None`` when both attempts fail. Row-major
    (see :func:`symmetric_eigen`).
    """
    for work_dtype in dict.fromkeys((factor.dtype, torch.float64)):
        shifted = factor.to(work_dtype)
        shifted = shifted + shift * torch.eye(len(shifted), dtype=work_dtype, device=shifted.device)
        cholesky, info = torch.linalg.cholesky_ex(shifted)
        if int(info) != 0:
            continue
        inverse = torch.cholesky_inverse(cholesky)
        if _all_finite(inverse):
            return inverse.to(dtype).contiguous()
    return None


def pi_correction(a_factor: Tensor, g_factor: Tensor) -> float:
    """Martens & Grosse's ``π = sqrt((tr A / dim A) / (tr G / dim G))``; 1 if either trace is 0."""
    a_mean = float(torch.trace(a_factor)) / len(a_factor)
    g_mean = float(torch.trace(g_factor)) / len(g_factor)
    if a_mean <= 0 or g_mean <= 0:
        return 1.0
    return (a_mean / g_mean) ** 0.5


def eigen_precondition(grad: Tensor, eig_a: Eigen, eig_g: Eigen, damping: float) -> Tensor:
    """``(G ⊗ A + λI)⁻¹ vec(∇W)`` for ``grad: (out, in)``, ``A: (in, in)``, ``G: (out, out)``.

    ``V = Q_G [(Q_Gᵀ ∇W Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ``, the exact damped Kronecker inverse.
    """
    rotated = eig_g.Q.T @ grad @ eig_a.Q
    rotated /= torch.outer(eig_g.d, eig_a.d).add_(damping)
    return eig_g.Q @ rotated @ eig_a.Q.T


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
    """Copy the upper triangle of a square ``matrix`` onto its lower triangle, in place.

    Tile by tile over the index ``spans`` (default: ``MIRROR_TILE`` wide; small transposed copies
    stay in cache, and one whole-matrix transposed copy is ~4× slower than a plain one on CPU).
    ``diagonal_tiles=False`` leaves the diagonal tiles as they are, for callers that computed
    those tiles whole.
    """
    if spans is None:
        spans = _spans([*range(0, len(matrix), MIRROR_TILE), len(matrix)])
    for j, (lo, hi) in enumerate(spans):
        if diagonal_tiles:
            tile = matrix[lo:hi, lo:hi]
            tile.copy_(tile.triu() + tile.triu(1).T)
        for lo2, hi2 in spans[j + 1 :]:
            matrix[lo2:hi2, lo:hi].copy_(matrix[lo:hi, lo2:hi2].T)
    return matrix


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
