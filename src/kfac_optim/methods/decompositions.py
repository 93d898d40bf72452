"""How a Kronecker factor is decomposed, shipped between ranks, saved and sized: one axis of a method.

Owns :class:`Decomposer` (the interface a ``methods.Method`` holds as its ``decomposer``) and the
two layouts of the built-in methods: :class:`EigenDecomposer` (eigenbases, full or capped at
``max_rank`` with an isotropic complement) and :class:`InverseDecomposer` (damped inverses by
Cholesky). The other axis, how a pair of decompositions is applied to a joint gradient (a damped
Kronecker inverse, Adam's second moment in the basis, a root), is the method's (``methods``), as
Distributed Shampoo separates its preconditioner from its matrix-function computation.
A decomposer owns its decomposition's tensors as they travel (a fixed order, the receivers'
buffers, which are symmetric), as checkpoints hold them (:meth:`Decomposer.saved`, read back
and checked against the factor), and their size (elements for the plan, bytes held).
Must not know: modules, hooks, ranks, schedules, how a pair is applied; a factor is read through
:class:`FactorView` (``layers.factor.Factor`` is one), so this module imports nothing of ``layers``.

Factor kinds (see ``layers.factor``): **dense** ``(n, n)``, or ``(k, n, n)`` for ``k`` independent
blocks (grouped convolutions), and **diagonal** ``(n,)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from kfac_optim import linalg
from kfac_optim.state import check_shapes, check_tensors

Decomposition = linalg.Eigen | Tensor


class FactorView(Protocol):
    """What a method or a decomposer reads of a factor (``layers.factor.Factor``): its kind
    (``diagonal``: stored as its diagonal ``(dim,)``; else dense ``(dim, dim)``, or ``(groups, dim,
    dim)`` with ``batch_shape == (groups,)``), its ``running`` average, the ``decomposition`` held,
    and how a symmetric tensor shaped as its storage is packed for checkpoints."""

    dim: int
    groups: int
    diagonal: bool
    device: torch.device
    running: Tensor
    decomposition: Decomposition | None

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """``()`` or ``(groups,)``: the storage's leading dimensions before the factor's own."""

    @property
    def rank_bound(self) -> int | None:
        """An upper bound of ``running``'s rank (None: unknown)."""

    def mean_eigenvalue(self) -> float:
        """``tr F / dim`` over all blocks."""

    def packed(self, matrix: Tensor) -> Tensor:
        """A symmetric tensor shaped as the storage as checkpoints hold it (its upper triangle)."""

    def unpacked(self, saved: Tensor) -> Tensor:
        """A new tensor shaped as the storage from :meth:`packed`'s output."""

    def packed_shape(self) -> tuple[int, ...]:
        """The shape of :meth:`packed`'s output."""


class Decomposer(ABC):
    """How a factor is decomposed, shipped and saved. Every method takes a factor of either kind."""

    @abstractmethod
    def decompose(
        self, factor: FactorView, shift: float, dtype: torch.dtype, drop_below: float | None = None
    ) -> Decomposition | None:
        """The decomposition of ``factor.running`` plus ``shift·I`` where the layout uses it, in
        ``dtype`` (None: it failed). ``drop_below``: eigenvalues that may count as 0."""

    def keyed_shift(self, shift: float) -> float:
        """The part of ``shift`` a decomposition depends on (its cache key)."""
        return shift

    def capped(self, factor: FactorView) -> bool:
        """Whether ``factor`` is held at a bounded rank (O(n²·rank) to decompose, not O(n³))."""
        return False

    @abstractmethod
    def tensors(self, factor: FactorView) -> list[Tensor]:
        """The tensors ``factor``'s decomposition travels as, in a fixed order."""

    @abstractmethod
    def buffers(self, factor: FactorView, dtype: torch.dtype, device: torch.device, columns: int) -> list[Tensor]:
        """Receive buffers shaped as :meth:`tensors` for ``factor`` whose owner's decomposition has
        ``columns`` (:meth:`columns`) (its decomposition's storage when it has the right layout, so
        receivers do not allocate fresh pages every time)."""

    def columns(self, factor: FactorView) -> int:
        """The last dimension of ``factor``'s decomposition's first tensor (``r`` of a thin ``Q``)."""
        return self.tensors(factor)[0].shape[-1]

    @abstractmethod
    def from_tensors(self, factor: FactorView, parts: Sequence[Tensor]) -> Decomposition:
        """Rebuild a decomposition of ``factor`` from :meth:`tensors`' output."""

    @abstractmethod
    def symmetric(self, factor: FactorView) -> list[bool]:
        """Per tensor of :meth:`tensors`: whether it is one symmetric ``(n, n)`` matrix (sent as a triangle)."""

    @abstractmethod
    def elements(self, diagonal: bool, dim: int, count: int = 1) -> int:
        """Elements of one decomposition of a factor of this kind, dimension and block count."""

    @abstractmethod
    def nbytes(self, decomposition: Decomposition | None) -> int:
        """Bytes held by ``decomposition`` (0 for None)."""

    @abstractmethod
    def saved(self, factor: FactorView, decomposition: Decomposition) -> Any:
        """``decomposition`` of ``factor`` as checkpoints hold it (tensors, nothing redundant)."""

    @abstractmethod
    def loaded(self, factor: FactorView, saved: Any) -> Decomposition:
        """The decomposition :meth:`saved` holds, on ``factor.device`` (``saved`` checked first)."""

    @abstractmethod
    def check_saved(self, factor: FactorView, saved: Any, field: str) -> None:
        """Raise ``ValueError`` naming ``field`` if ``saved`` is not :meth:`saved`'s form of a
        decomposition of ``factor`` (its shapes, finite)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def reuse(held: list[Tensor] | None, wanted: list[tuple[tuple[int, ...], torch.dtype]],
          device: torch.device) -> list[Tensor]:
    """``held`` when it matches ``wanted`` shapes/dtypes on ``device`` (contiguous), else new empty tensors."""
    if held is not None and len(held) == len(wanted) and all(
        tuple(t.shape) == shape and t.dtype == dtype and t.device == device and t.is_contiguous()
        for t, (shape, dtype) in zip(held, wanted, strict=True)
    ):
        return held
    return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in wanted]


@dataclass(frozen=True)
class EigenDecomposer(Decomposer):
    """``F = Q diag(d) Qᵀ`` (``linalg.Eigen``, eigenvalues clamped at 0; a diagonal factor is its
    clamped diagonal, ``Q = I``). No shift: the decomposition does not depend on it.

    ``max_rank`` (None: full eigenbases, else the eigenbasis cap): a dense ungrouped factor wider
    than ``min_dim`` (None: ``max_rank``; else at least ``max_rank``) is held as at most
    ``max_rank`` leading eigenpairs plus ``complement`` σ, the mean of
    the rest (``linalg.symmetric_eigen``); it travels with σ (``(1,)``, 0 when it has none).
    A ``Q`` may be thin (``(n, r)``) when few eigenvalues exceed ``drop_below``.
    Checkpoints: ``{"Q", "d"}`` and ``"complement"`` when held; a diagonal factor's tensor."""

    max_rank: int | None = None
    min_dim: int | None = None

    def capped(self, factor: FactorView) -> bool:
        """Whether the cap applies to ``factor``'s layout: dense, ungrouped and wider than ``min_dim``
        (``max_rank`` when None)."""
        if self.max_rank is None or factor.diagonal or factor.groups != 1:
            return False
        return factor.dim > (self.max_rank if self.min_dim is None else self.min_dim)

    def decompose(
        self, factor: FactorView, shift: float, dtype: torch.dtype, drop_below: float | None = None
    ) -> Decomposition | None:
        if factor.diagonal:
            return factor.running.clamp(min=0).to(dtype)
        max_rank = self.max_rank if self.capped(factor) else None
        return linalg.symmetric_eigen(factor.running, dtype, drop_below, factor.rank_bound, max_rank)

    def keyed_shift(self, shift: float) -> float:
        return 0.0

    def tensors(self, factor: FactorView) -> list[Tensor]:
        decomposition = factor.decomposition
        assert decomposition is not None
        if factor.diagonal:
            return [decomposition]
        if not self.capped(factor):
            return [decomposition.Q, decomposition.d]
        complement = decomposition.complement  # None: held from a checkpoint of an uncapped run
        return [decomposition.Q, decomposition.d, decomposition.d.new_zeros(1) if complement is None else complement]

    def buffers(self, factor: FactorView, dtype: torch.dtype, device: torch.device, columns: int) -> list[Tensor]:
        batch, n = factor.batch_shape, factor.dim
        if factor.diagonal:
            wanted = [((n,), dtype)]
        else:  # Q (..., n, r), d (..., r): r < n when held thin (linalg.symmetric_eigen); σ (1,) when capped
            wanted = [((*batch, n, columns), dtype), ((*batch, columns), dtype)]
            if self.capped(factor):
                wanted.append(((1,), dtype))
        held = None
        if factor.decomposition is not None and isinstance(factor.decomposition, linalg.Eigen) != factor.diagonal:
            held = self.tensors(factor)
        return reuse(held, wanted, device)

    def from_tensors(self, factor: FactorView, parts: Sequence[Tensor]) -> Decomposition:
        if factor.diagonal:
            return parts[0]
        truncated = self.capped(factor) and parts[0].shape[-1] == self.max_rank
        return linalg.Eigen(Q=parts[0], d=parts[1], complement=parts[2] if truncated else None)

    def symmetric(self, factor: FactorView) -> list[bool]:
        return [False] * (1 if factor.diagonal else 3 if self.capped(factor) else 2)

    def elements(self, diagonal: bool, dim: int, count: int = 1) -> int:
        """A full decomposition's: an upper bound for a thin one, or one the cap truncates (whether the
        cap applies depends on the other factor of the pair, which the plan does not see)."""
        return dim if diagonal else count * (dim * dim + dim)

    def nbytes(self, decomposition: Decomposition | None) -> int:
        if decomposition is None:
            return 0
        if isinstance(decomposition, Tensor):
            return decomposition.nbytes
        complement = 0 if decomposition.complement is None else decomposition.complement.nbytes
        return decomposition.Q.nbytes + decomposition.d.nbytes + complement

    def saved(self, factor: FactorView, decomposition: Decomposition) -> Any:
        if factor.diagonal:
            return decomposition
        state = {"Q": decomposition.Q, "d": decomposition.d}
        if decomposition.complement is not None:
            state["complement"] = decomposition.complement
        return state

    def loaded(self, factor: FactorView, saved: Any) -> Decomposition:
        device = factor.device
        if factor.diagonal:
            return saved.to(device, copy=True)
        complement = saved.get("complement")
        return linalg.Eigen(Q=saved["Q"].to(device), d=saved["d"].to(device),
                            complement=None if complement is None else complement.to(device))

    def check_saved(self, factor: FactorView, saved: Any, field: str) -> None:
        if factor.diagonal:
            check_tensors({field: saved})
            check_shapes({field: saved}, {field: (factor.dim,)})
            return
        if not isinstance(saved, dict):
            raise ValueError(f"'{field}' must be a dict with 'Q' and 'd' (an eigendecomposition), "
                             f"got {type(saved).__name__}")
        for key in ("Q", "d"):
            if key not in saved:
                raise ValueError(f"'{field}' has no '{key}'")
        tensors = {f"{field} {key}": saved[key] for key in ("Q", "d", "complement") if key in saved}
        check_tensors(tensors)
        rank = saved["Q"].shape[-1]
        expected = {f"{field} Q": (*factor.batch_shape, factor.dim, rank), f"{field} d": (*factor.batch_shape, rank)}
        if "complement" in saved:
            expected[f"{field} complement"] = (1,)
        check_shapes(tensors, expected)


class InverseDecomposer(Decomposer):
    """``(F + shift·I)⁻¹`` by Cholesky (``linalg.damped_inverse``); a diagonal factor's is the vector
    ``1 / (d + shift)``. Dense whatever the rank (no cap). Travels as one tensor (a triangle when
    it is one symmetric matrix); checkpoints hold it packed (``FactorView.packed``)."""

    def decompose(
        self, factor: FactorView, shift: float, dtype: torch.dtype, drop_below: float | None = None
    ) -> Decomposition | None:
        if factor.diagonal:
            inverse = (factor.running.clamp(min=0) + shift).reciprocal().to(dtype)
            return inverse if bool(torch.isfinite(inverse.sum())) else None
        return linalg.damped_inverse(factor.running, shift, dtype)

    def tensors(self, factor: FactorView) -> list[Tensor]:
        assert factor.decomposition is not None
        return [factor.decomposition]

    def buffers(self, factor: FactorView, dtype: torch.dtype, device: torch.device, columns: int) -> list[Tensor]:
        shape = (factor.dim,) if factor.diagonal else (*factor.batch_shape, factor.dim, factor.dim)
        held = [factor.decomposition] if isinstance(factor.decomposition, Tensor) else None
        return reuse(held, [(shape, dtype)], device)

    def from_tensors(self, factor: FactorView, parts: Sequence[Tensor]) -> Decomposition:
        return parts[0]

    def symmetric(self, factor: FactorView) -> list[bool]:
        return [not factor.diagonal and factor.groups == 1]

    def elements(self, diagonal: bool, dim: int, count: int = 1) -> int:
        return dim if diagonal else count * dim * dim

    def nbytes(self, decomposition: Decomposition | None) -> int:
        return 0 if decomposition is None else decomposition.nbytes

    def saved(self, factor: FactorView, decomposition: Decomposition) -> Any:
        return factor.packed(decomposition)

    def loaded(self, factor: FactorView, saved: Any) -> Decomposition:
        return factor.unpacked(saved.to(factor.device))

    def check_saved(self, factor: FactorView, saved: Any, field: str) -> None:
        check_tensors({field: saved})
        check_shapes({field: saved}, {field: factor.packed_shape()})
