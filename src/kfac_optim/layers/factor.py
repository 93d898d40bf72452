"""Kronecker factors: one symmetric factor's pending statistics, running average and decomposition.

Owns: the factor's storage (allocated on first use), accumulating Gram matrices (or a diagonal's
counts) since the last fold, folding them into the running average (non-finite batches discarded,
no host sync), the decomposition held and when it is stale, its checkpoint state
(``kfac_optim.state``'s protocol, the method handed in); :func:`output_gram_scale`, the one place
the output-gradient scaling of the conventions below is written.
Must not know: modules, blocks, hooks, ranks; which method decomposes (a ``methods.Method`` is
handed in and does the math); the geometry of a ``layers.support.Support`` (e.g. ``layers.conv``'s boxes).

Conventions (docs/numerics.md), for a layer with joint weight ``[W | b]`` of shape ``(out, in [+1])``:
  ``A = (1/(N·R)) Σ a aᵀ``: ``(in [+1], in [+1])``, ``a`` the input rows with a trailing 1 for a bias;
  ``G = (1/N) Σ ĝ ĝᵀ``: ``(out, out)``, ``ĝ = N·g`` for a mean-reduced loss (``ĝ = g`` for "sum"),
over the N·R rows of N samples since the last fold. Factor kinds: dense ``(dim, dim)``, batched
dense ``(groups, dim, dim)`` (independent blocks of one layer), diagonal ``(dim,)``.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from kfac_optim import linalg
from kfac_optim.layers.support import EMPTY_SUPPORT, Support
from kfac_optim.state import check_shapes, check_tensors

if TYPE_CHECKING:
    from kfac_optim.methods import Method
    from kfac_optim.methods.decompositions import Decomposer, Decomposition

FactorName = Literal["A", "G"]


def output_gram_scale(samples: int, loss_reduction: str, grad_scale: float | Tensor = 1.0) -> float | Tensor:
    """What turns ``Σ g gᵀ`` of the captured output-gradients ``g`` of ``samples`` (N) samples into
    ``G = (1/N) Σ ĝ ĝᵀ``: ``grad_scale·N`` for a mean-reduced loss (``ĝ = N·g``), ``grad_scale/N``
    for "sum" (``ĝ = g``). ``grad_scale`` multiplies the Gram further, e.g. ``scale⁻²`` for
    gradients captured under a loss scale."""
    return grad_scale * (samples if loss_reduction == "mean" else 1.0 / samples)


class Factor:
    """One dense symmetric Kronecker factor: pending sum, running average, decomposition.

    ``running`` is ``(dim, dim)``, or ``(groups, dim, dim)`` for ``groups > 1`` independent
    blocks of one layer (a grouped convolution: one Kronecker pair per group). The running average
    only changes through device-side selects, so folding a batch needs no host sync: a non-finite
    batch leaves the factor as it was and counts one discard.

    Supports (:class:`Support`; None: unknown, all indices): ``pending_support`` holds every
    nonzero row/column of ``pending`` when the statistics were added with one (``add_gram``'s
    ``support``), ``support`` every nonzero row/column ``running`` has ever had (the union of what
    was folded). Folding then touches only the ``(U, U)`` block of their union ``U``: outside it
    both are zero and stay so, and the fold's arithmetic is elementwise, so the result is the
    same, bit for bit, as folding the whole matrix. ``running`` changes only through this class
    (fold, :meth:`set_global`, :meth:`load_state_dict`), which keeps that so; code that writes it
    otherwise must set ``support`` to None.
    """

    diagonal = False

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device, groups: int = 1) -> None:
        self.dim = dim
        self.groups = groups
        self.dtype = dtype
        self.device = device
        self.pending_rows = 0  # pending and running: allocated on first use (see allocated)
        self.pending_support: Support | None = None
        self.support: Support | None = EMPTY_SUPPORT
        self.initialized = torch.zeros((), dtype=torch.bool, device=device)
        self.discarded = torch.zeros((), dtype=torch.int64, device=device)
        self.reported_discards = 0
        self.version = 0
        # Rows folded so far: globally as of the last set_global, and locally since. Their sum
        # bounds the running factor's rank (a decayed sum of Gram matrices); None: unknown.
        self.rows_synced: int | None = 0
        self.rows_since_sync = 0
        self.decomposition: linalg.Eigen | Tensor | None = None
        self.decomposed_key: tuple[int, float] | None = None

    @staticmethod
    def storage_shape(dim: int, groups: int) -> tuple[int, ...]:
        return (dim, dim) if groups == 1 else (groups, dim, dim)

    # -- storage, allocated on first use ------------------------------------------------------
    # ``pending`` and ``running`` are plain attributes once they exist. Until then they are zeros
    # that are not held: the first read allocates them (``__getattr__`` runs only for missing
    # attributes, so reads after that cost nothing more). A factor of a layer frozen when the
    # optimizer is built thus holds no memory until its layer records (a LoRA fine-tune's frozen
    # base layers never do); :meth:`allocate` allocates both at once.

    def __getattr__(self, name: str) -> Tensor:
        if name in ("pending", "running") and "dim" in self.__dict__:
            value = torch.zeros(self.storage_shape(self.dim, self.groups), dtype=self.dtype, device=self.device)
            setattr(self, name, value)
            return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def allocated(self) -> bool:
        """Whether the running factor's storage exists (False: it is zeros, never read or written)."""
        return "running" in self.__dict__

    def allocate(self) -> None:
        """Allocate ``pending`` and ``running`` (zeros) now, if not yet."""
        self.pending, self.running  # noqa: B018 (reading allocates)

    def release(self) -> None:
        """Drop the running factor's storage: it is zeros again, not held (a loaded never-allocated one)."""
        self.__dict__.pop("running", None)

    def held_bytes(self) -> tuple[int, int]:
        """Bytes of ``(running, pending)`` allocated now (0 for storage never used)."""
        return tuple(self.__dict__[n].nbytes if n in self.__dict__ else 0 for n in ("running", "pending"))  # type: ignore[return-value]

    @property
    def elements(self) -> int:
        """Elements of one storage-shaped tensor (``pending`` or ``running``), allocated or not."""
        return math.prod(self.storage_shape(self.dim, self.groups))

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading dimensions of the storage before the factor's own: ``()`` or ``(groups,)``."""
        return () if self.groups == 1 or self.diagonal else (self.groups,)

    def describe(self) -> str:
        """The storage's shape and the factor kind, e.g. ``"3x9x9 dense"``."""
        return f"{self._shape_text()} dense"

    def _shape_text(self) -> str:
        text = "x".join(str(d) for d in self.storage_shape(self.dim, self.groups))
        return text if self.allocated else f"{text} (not allocated yet)"

    def diagonal_of(self, matrix: Tensor) -> Tensor:
        """The diagonal entries of a tensor shaped as this factor's storage."""
        return matrix.diagonal(dim1=-2, dim2=-1)

    def mean_eigenvalue(self) -> float:
        """``tr F / dim`` over all blocks (a host sync; used by the damped inverse's π)."""
        return float(self.diagonal_of(self.running).mean())

    def add_gram(
        self, rows: Tensor, append_ones: bool = False, group: int | None = None, support: Support | None = None,
        count: int | None = None,
    ) -> None:
        """Accumulate ``rowsᵀ rows`` for ``rows: (R, dim[-1])``, or ``(groups, R, dim[-1])`` per block,
        or into block ``group`` only (a trailing 1 when ``append_ones``).

        ``count`` (default: all R): how many of the rows are real; the others are zero rows of
        padded positions (``layers.positions``), which add nothing and are not counted (nor get the
        trailing 1).

        ``support`` (with ``group`` None): the rows' columns are the indices of ``support`` in
        order (with the trailing 1 at the last of them) and every other column is zero: only
        ``pending``'s block on ``support`` is touched.
        """
        if group is not None and support is not None:
            raise ValueError("add_gram: a support applies to the whole pending sum, not to one group")
        target = self._pending_block(support)
        if group is not None:
            target = target[group]
        n = rows.shape[-1]
        if rows.dim() == 2 and target.dim() == 2:
            linalg.add_gram_(target[:n, :n], rows)
        else:
            target[..., :n, :n].baddbmm_(rows.mT, rows)
        self._add_row_count(target, rows.shape[-2] if count is None else count,
                            rows.sum(dim=-2) if append_ones else None)
        self._put_pending_block(target, support)

    def add_column_gram(self, columns: Tensor, append_ones: bool = False, support: Support | None = None) -> None:
        """As :meth:`add_gram` for the ``B·L`` rows ``columns[b, :, l]`` of ``columns: (B, dim[-1], L)``."""
        target = self._pending_block(support)
        n = columns.shape[1]
        linalg.add_column_gram_(target[:n, :n], columns)
        rows = columns.shape[0] * columns.shape[2]
        self._add_row_count(target, rows, columns.sum(dim=(0, 2)) if append_ones else None)
        self._put_pending_block(target, support)

    def _pending_block(self, support: Support | None) -> Tensor:
        """``pending`` itself (``support`` None), or a copy of its block on ``support``; notes the
        support of what is about to be added (call before counting its rows)."""
        if support is None or self.pending_support is None:
            self.pending_support = support if self.pending_rows == 0 else None
        else:
            self.pending_support |= support
        if support is None:
            return self.pending
        if self.pending_rows == 0:  # pending is all zeros
            return self.pending.new_zeros(*self.pending.shape[:-2], support.size, support.size)
        return support.gather(self.pending)

    def _put_pending_block(self, block: Tensor, support: Support | None) -> None:
        """Write a block from :meth:`_pending_block` back (no-op for ``pending`` itself)."""
        if support is not None:
            support.scatter(self.pending, block)

    def _add_row_count(self, target: Tensor, rows: int, row_sum: Tensor | None) -> None:
        """Count ``rows`` more rows; with a bias, add their sum and count to ``target``'s trailing row/column."""
        if row_sum is not None:
            n = row_sum.shape[-1]
            target[..., :n, n].add_(row_sum)  # in place on the views (``+=`` would copy each back onto itself)
            target[..., n, :n].add_(row_sum)
            target[..., n, n].add_(rows)
        self.pending_rows += rows

    def discard_pending(self) -> None:
        """Forget the pending statistics. ``pending`` is all zeros whenever ``pending_rows == 0``,
        so a factor that accumulated nothing (every non-factor step) costs no n² pass."""
        if self.pending_rows:
            if self.pending_support is None:
                self.pending.zero_()
            else:
                self.pending_support.zero(self.pending)
            self.pending_rows = 0
        self.pending_support = None

    def fold(self, scale: float | Tensor, decay: float) -> None:
        """``F ← decay·F + (1−decay)·scale·pending`` (``F ← scale·pending`` on the first fold).

        A non-finite batch leaves ``F`` as it was (one discard counted); a non-finite ``F``
        (however it got there) is reset to the batch instead of being averaged into. With known
        supports (see the class docstring) only their union's block is folded.
        """
        support = None if self.pending_support is None or self.support is None else self.support | self.pending_support
        if support is None or support.size == self.dim:
            self._fold_into(self.running, self.pending, scale, decay)
        else:
            running = support.gather(self.running)
            self._fold_into(running, support.gather(self.pending), scale, decay)
            support.scatter(self.running, running)
        self.support = support
        self.version += 1
        self.rows_since_sync += self.pending_rows
        self.discard_pending()

    def _fold_into(self, running: Tensor, batch: Tensor, scale: float | Tensor, decay: float) -> None:
        """The fold's arithmetic on ``running`` and ``batch`` (``running``, ``pending`` or blocks of
        both); ``running`` and ``batch`` are modified in place."""
        # In place, no n×n temporaries (fresh CPU pages cost more than the arithmetic; isfinite
        # and where are slow on CPU): F ← F + w·(batch − F) with w = 1 − decay once initialized,
        # 1 before or when F is not finite (exactly batch: non-finite entries of F are zeroed first),
        # 0 for a non-finite batch (zeroed first so 0·nan cannot leak). F and the batch are sums of
        # Gram matrices, finite iff their diagonal is (|F_ij| ≤ √(F_ii F_jj)): O(n) checks.
        batch = batch.mul_(scale)
        finite = torch.isfinite(self.diagonal_of(batch).sum())
        keep_running = self.initialized & torch.isfinite(self.diagonal_of(running).sum())
        weight = finite.to(batch.dtype) * (1 - keep_running.to(batch.dtype) * decay)
        running.nan_to_num_(0.0, 0.0, 0.0).lerp_(batch.nan_to_num_(0.0, 0.0, 0.0), weight)
        self.symmetrize_(running)
        self.initialized |= finite
        self.discarded += ~finite

    def symmetrize_(self, matrix: Tensor) -> None:
        """Copy the upper triangle of ``matrix`` (shaped as the storage, or a block of it) onto its
        lower one, in place: exactly symmetric whatever rounding made them differ (a BLAS kernel's
        Gram, a communicator's sum order, an elementwise kernel's vector and scalar paths).
        Once per fold, not per added Gram: one pass over the matrix."""
        linalg.mirror_upper_(matrix)

    def snapshot(self) -> Factor:
        """A shallow copy holding a copy of ``running``: what a background decomposition reads
        while this factor keeps folding (see ``kfac_optim.background.decompositions``)."""
        copied = copy.copy(self)
        copied.running = self.running.clone()
        return copied

    @property
    def rank_bound(self) -> int | None:
        """An upper bound of the running factor's rank (the rows folded into it), None if unknown."""
        return None if self.rows_synced is None else self.rows_synced + self.rows_since_sync

    def decompose(self, method: Method, shift: float, dtype: torch.dtype, drop_below: float | None = None) -> bool:
        """Refresh the decomposition unless the factor and shift are unchanged since the last one.

        ``method`` decides what is held (e.g. ``Q diag(d) Qᵀ``, thin when few eigenvalues are above
        ``drop_below`` (see ``linalg.symmetric_eigen``, which also uses :attr:`rank_bound`), or
        ``(F + shift·I)⁻¹``) and which part of ``shift`` it depends on. Returns False when it
        failed (the old one is kept).
        """
        if not self.needs_decomposition(method, shift):
            return True
        result = method.decompose(self, shift, dtype, drop_below)
        if result is None:
            return False
        self.adopt(result, method.keyed_shift(shift))
        return True

    def needs_decomposition(self, method: Method, shift: float) -> bool:
        """Whether the factor or the shift changed since the decomposition held (or none is held)."""
        return (self.version, method.keyed_shift(shift)) != self.decomposed_key

    def set_global(self, total: Tensor, ranks: Tensor, rows: int) -> None:
        """Become the mean of several ranks' running factors (distributed training).

        ``total``: shaped as ``running``, the sum of the ranks' running factors, where a rank whose
        factor is not initialized contributed zeros; ``ranks``: 0-dim, how many were initialized;
        ``rows``: the sum of the ranks' ``rows_since_sync``. The result is initialized if any was,
        and counts as a new version of the factor.
        """
        self.running = total.div_(ranks.clamp(min=1))
        self.symmetrize_(self.running)  # a batched factor's total travels whole: its triangles may differ
        self.support = None  # the other ranks' supports are not known here
        self.initialized = ranks > 0
        self.version += 1
        if self.rows_synced is not None:
            self.rows_synced += rows
        self.rows_since_sync = 0

    def set_running(self, value: Tensor, initialized: Tensor, rank_bound: int | None) -> None:
        """Become ``value`` (shaped as ``running``), a factor derived from others (e.g. a tied
        weight's nearest Kronecker product), with their ``initialized`` and ``rank_bound``; counts
        as a new version of the factor."""
        self.running = value
        self.support = None
        self.initialized = initialized
        self.version += 1
        self.rows_synced, self.rows_since_sync = rank_bound, 0

    def adopt(self, decomposition: linalg.Eigen | Tensor | None, shift: float, version: int | None = None) -> None:
        """Hold ``decomposition`` of the running factor at ``version`` (default: the current one),
        computed elsewhere with ``shift`` (None: hold none)."""
        self.decomposition = decomposition
        version = self.version if version is None else version
        self.decomposed_key = None if decomposition is None else (version, shift)

    def state_dict(self, method: Method | None = None) -> dict[str, Any]:
        """The running factor (packed: :meth:`packed_running`; None while never allocated: zeros, its
        layer frozen since the optimizer was built), its health counters and its decomposition as
        ``method``'s decomposer saves it (``Decomposer.saved``; None if none yet). ``method``: the
        one whose decomposition is held (may be None while none is: ``ValueError`` otherwise)."""
        return {
            "running": self.packed_running() if "running" in self.__dict__ else None,
            "initialized": self.initialized,
            "discarded": self.discarded,
            "version": self.version,
            "rank_bound": self.rank_bound,
            "decomposition": self.saved_decomposition(method, self.decomposition),
            "decomposed_key": self.decomposed_key,
        }

    def packed_running(self) -> Tensor:
        """The running factor as checkpoints hold it (:meth:`packed`)."""
        return self.packed(self.running)

    def packed(self, matrix: Tensor) -> Tensor:
        """A symmetric tensor shaped as this factor's storage (the running factor, a damped
        inverse) as checkpoints hold it: its upper triangle, ``(n(n+1)/2,)`` per block
        (``(groups, n(n+1)/2)`` for a batched factor; ``linalg.pack_symmetric``'s layout). Every
        writer keeps them exactly symmetric (each fold and :meth:`set_global` end with
        :meth:`symmetrize_`, whatever rounding the Gram kernels or the communicator did; triangles
        broadcast; ``cholesky_inverse``), so :func:`unpack_running` restores them bit for bit."""
        if matrix.dim() == 2:
            return linalg.pack_symmetric(matrix)
        return torch.stack([linalg.pack_symmetric(block) for block in matrix])

    def packed_shape(self) -> tuple[int, ...]:
        """The shape of :meth:`packed`."""
        return (*self.batch_shape, linalg.triu_size(self.dim))

    def unpacked(self, saved: Tensor) -> Tensor:
        """A new tensor shaped as the storage from :meth:`packed`'s output (:func:`unpack_running`)."""
        return unpack_running(saved, self.dim, self.groups, self.diagonal)

    def saved_decomposition(self, method: Method | None, decomposition: Decomposition | None) -> Any:
        """``decomposition`` (of this factor) as ``method``'s decomposer saves it; None for None."""
        if decomposition is None:
            return None
        return _decomposer(method, "state_dict").saved(self, decomposition)

    def loaded_decomposition(self, method: Method | None, saved: Any) -> Decomposition | None:
        """The decomposition ``saved`` (checked: :meth:`check_decomposition`) holds, on this factor's device."""
        return None if saved is None else _decomposer(method, "load_state_dict").loaded(self, saved)

    def check_decomposition(self, method: Method | None, saved: Any, field: str = "decomposition") -> None:
        """Raise ``ValueError`` naming ``field`` if ``saved`` (None: none) is not a saved decomposition
        of this factor in ``method``'s layout (``Decomposer.check_saved``)."""
        if saved is not None:
            if method is None:
                raise ValueError(f"'{field}' is saved but no method was given to read it")
            method.decomposer.check_saved(self, saved, field)

    def check_state(self, state: Any, method: Method | None = None) -> None:
        """Raise ``ValueError`` naming the field if ``state`` is not a usable :meth:`state_dict` of this
        factor: every key present, ``running`` packed (:meth:`packed_shape`), the decomposition
        ``method``'s, all finite; nothing is changed."""
        if not isinstance(state, dict):
            raise ValueError(f"expected a dict, got {type(state).__name__}")
        for key in ("running", "initialized", "discarded", "version", "decomposition", "decomposed_key"):
            if key not in state:
                raise ValueError(f"'{key}' is missing")
        tensors = {"running": state["running"], "initialized": state["initialized"], "discarded": state["discarded"]}
        if tensors["running"] is None:  # never allocated when saved: zeros, so never initialized
            del tensors["running"]
            if not isinstance(state["initialized"], Tensor) or bool(state["initialized"]):
                raise ValueError("'running' is None (never allocated) but 'initialized' is not False")
        check_tensors(tensors)
        self.check_decomposition(method, state["decomposition"])
        bound = state.get("rank_bound")
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
            raise ValueError(f"'rank_bound' must be None or an int >= 0, got {bound!r}")
        expected = {"initialized": (), "discarded": ()}
        if "running" in tensors:
            expected["running"] = self.packed_shape()
        check_shapes(tensors, expected)

    def load_state_dict(self, state: dict[str, Any], method: Method | None = None) -> None:
        """Restore from :meth:`state_dict` (tensors move to this factor's device and dtypes; ``running``
        packed, or None: never allocated; the decomposition read by ``method``'s decomposer); the
        caller checks ``state`` first (:meth:`check_state`)."""
        device, dtype = self.device, self.dtype
        if state["running"] is None:
            self.release()
        else:
            self.running = self.unpacked(state["running"].to(device, dtype))
        self.support = None
        self.initialized = state["initialized"].to(device, copy=True)
        self.discarded = state["discarded"].to(device, copy=True)
        self.reported_discards = int(self.discarded)
        self.version = int(state["version"])
        self.rows_synced, self.rows_since_sync = state.get("rank_bound"), 0  # None: saved without one
        decomposition = self.loaded_decomposition(method, state["decomposition"])
        self.decomposition = decomposition
        key = state["decomposed_key"]
        self.decomposed_key = None if key is None or decomposition is None else tuple(key)
        self.discard_pending()


def _decomposer(method: Method | None, what: str) -> Decomposer:
    """``method``'s decomposer; ``ValueError`` naming ``what`` when a decomposition is at stake and no method is
    given."""
    if method is None:
        raise ValueError(f"Factor.{what}(method=None): a decomposition is held or saved, pass method= (the Method "
                         "whose decomposer made it)")
    return method.decomposer


def unpack_running(saved: Tensor, dim: int, groups: int = 1, diagonal: bool = False) -> Tensor:
    """A new tensor holding the running factor (or a damped inverse; ``dim``, ``groups`` and kind
    as the :class:`Factor`'s) that a checkpoint saved as ``saved`` (:meth:`Factor.packed`: a diagonal
    factor's ``(dim,)`` itself)."""
    if diagonal:
        return saved.clone()
    if groups == 1:
        return linalg.unpack_symmetric(saved, dim)
    return torch.stack([linalg.unpack_symmetric(packed, dim) for packed in saved])


class DiagonalFactor(Factor):
    """A diagonal factor stored as its diagonal ``(dim,)`` (e.g. an embedding's ``A``: token
    frequencies), O(dim) memory; statistics are added as per-row sums of squares (or counts)."""

    diagonal = True

    @staticmethod
    def storage_shape(dim: int, groups: int) -> tuple[int, ...]:
        return (dim,)

    def describe(self) -> str:
        return f"{self._shape_text()} diagonal"

    def packed(self, matrix: Tensor) -> Tensor:
        """A diagonal ``(dim,)`` itself: it holds nothing twice."""
        return matrix

    def packed_shape(self) -> tuple[int, ...]:
        return (self.dim,)

    def diagonal_of(self, matrix: Tensor) -> Tensor:
        return matrix

    def symmetrize_(self, matrix: Tensor) -> None:
        """Nothing: a diagonal holds each entry once."""

    def add_counts(self, counts: Tensor, rows: int) -> None:
        """Add ``counts: (dim,)`` (the diagonal of ``Σ a aᵀ`` over ``rows`` rows) to the pending sum."""
        self.pending += counts
        self.pending_rows += rows

    def add_gram(self, rows: Tensor, append_ones: bool = False) -> None:
        raise TypeError("a diagonal factor takes statistics through add_counts")

    add_column_gram = add_gram
