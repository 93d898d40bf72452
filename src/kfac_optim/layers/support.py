"""Supports: the indices of a symmetric factor outside which it is zero (what a fold may skip).

Owns the :class:`Support` interface and the empty support (:data:`EMPTY_SUPPORT`, a factor with
nothing folded yet); ``layers.factor.Factor`` keeps the union of what it folded.
Must not know: a support's geometry (``layers.conv.BoxSupport`` is one), factors, blocks.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class Support(Protocol):
    """A set of a symmetric factor's ``(n, n)`` indices outside which it is zero: its rows and
    columns there form a block ``(size, size)`` (in index order). Host-side: combining supports
    needs no host sync. ``layers.conv.BoxSupport`` is the one a convolution's ``A`` has."""

    @property
    def size(self) -> int:
        """How many indices are in it."""

    def __or__(self, other: Support) -> Support | None:
        """A support holding both; None when it cannot say (then: every index)."""

    def gather(self, matrix: Tensor) -> Tensor:
        """A copy of ``matrix (..., n, n)``'s block on this support: ``(..., size, size)``."""

    def scatter(self, matrix: Tensor, block: Tensor) -> None:
        """Write ``block`` (as from :meth:`gather`) into ``matrix``'s block on this support."""

    def zero(self, matrix: Tensor) -> None:
        """Zero ``matrix``'s block on this support."""


class _NoIndex:
    """The empty :class:`Support`: a factor that is zero (nothing folded yet)."""

    size = 0

    def __or__(self, other: Support) -> Support:
        return other

    def gather(self, matrix: Tensor) -> Tensor:
        return matrix.new_empty(*matrix.shape[:-2], 0, 0)

    def scatter(self, matrix: Tensor, block: Tensor) -> None:
        return None

    def zero(self, matrix: Tensor) -> None:
        return None


EMPTY_SUPPORT: Support = _NoIndex()
