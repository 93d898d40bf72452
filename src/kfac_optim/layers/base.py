"""One Kronecker block: a layer's two factors, their statistics and its preconditioner.

Owns: pending statistics (sums since the last fold, with their counts), running factors, their
decompositions, and turning a layer's gradient into the preconditioned direction.
Must not know: hooks, param groups, ranks, loss scaling (callers pass plain scales).

Conventions (docs/design.md §3), for a layer with joint weight ``[W | b]`` of shape ``(out, in [+1])``:
  ``A = (1/(N·R)) Σ a aᵀ``: ``(in [+1], in [+1])``, ``a`` the input rows with a trailing 1 for a bias;
  ``G = (1/N) Σ ĝ ĝᵀ``: ``(out, out)``, ``ĝ = N·g`` for a mean-reduced loss (``ĝ = g`` for "sum"),
over the N·R rows of N samples since the last fold.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfac_optim import linalg
from kfac_optim.methods import Method

logger = logging.getLogger(__name__)

FactorName = Literal["A", "G"]

_replayed_task = threading.local()


def current_graph_task() -> int:
    """The autograd graph task (one backward pass) whose output-gradients are being recorded:
    the one running on this thread (-1: none), or the one :func:`in_graph_task` replays."""
    task: int | None = getattr(_replayed_task, "id", None)
    return torch._C._current_graph_task_id() if task is None else task


@contextlib.contextmanager
def in_graph_task(task: int) -> Iterator[None]:
    """Record statistics captured in graph task ``task`` as if inside it, on another thread (the
    statistics worker of ``KFAC(async_statistics=True)``): per-backward bookkeeping such as
    :meth:`KroneckerBlock.count_samples` sees the backward pass the pair came from."""
    _replayed_task.id = task
    try:
        yield
    finally:
        _replayed_task.id = None


class Capture(Protocol):
    """What a block that installs its own hooks needs from the statistics capture."""

    def should_capture(self, module: nn.Module) -> bool:
        """Whether a forward of ``module`` now should record statistics."""

    def tap(self, block: KroneckerBlock, layer_input: Any, output: Tensor) -> None:
        """Record ``(layer_input, output's gradient)`` for ``block`` when that gradient arrives
        (``output`` must require grad)."""


@dataclass(frozen=True)
class Support:
    """Where a symmetric factor ``(n, n)`` can be nonzero: the rows and columns of a box of its
    leading ``prod(shape)`` indices viewed as an array of ``shape`` (``box``: ``(lo, hi)`` per entry
    of ``shape``), and its trailing ``extra`` indices; zero everywhere else. E.g. a convolution's
    ``A`` viewed as ``(C_in, *kernel)`` with a bias: ``extra = 1``, and ``box`` all channels and the
    kernel offsets that read inside the input.

    A box, so that its block is a strided view (no index gather). Host-side: unions need no host
    sync. An empty ``shape`` holds no index at all (``EMPTY_SUPPORT``: a zero factor).
    """

    shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    extra: int = 0

    @property
    def size(self) -> int:
        """How many indices are in it."""
        return math.prod(hi - lo for lo, hi in self.box) + self.extra if self.shape else 0

    def __or__(self, other: Support) -> Support | None:
        """A support holding both (the box's hull); None (unknown) for different layouts."""
        if not other.shape or other == self:
            return self
        if not self.shape:
            return other
        if (self.shape, self.extra) != (other.shape, other.extra):
            return None
        box = tuple((min(a, c), max(b, d)) for (a, b), (c, d) in zip(self.box, other.box, strict=True))
        return Support(self.shape, box, self.extra)

    def _views(self, matrix: Tensor) -> list[Tensor]:
        """Views of ``matrix (..., n, n)`` that together are its block on this support."""
        m, dims = math.prod(self.shape), len(self.shape)
        cut = tuple(slice(lo, hi) for lo, hi in self.box)
        whole = matrix[..., :m, :m].unflatten(-1, self.shape).unflatten(-1 - dims, self.shape)
        views = [whole[(..., *cut, *cut)]]
        if self.extra:
            views.append(matrix[..., m:, :m].unflatten(-1, self.shape)[(..., *cut)])
            views.append(matrix[..., :m, m:].unflatten(-2, self.shape)[(..., *cut, slice(None))])
            views.append(matrix[..., m:, m:])
        return views

    def _block_views(self, block: Tensor) -> list[Tensor]:
        """Views of a compact ``block (..., size, size)`` matching :meth:`_views` one for one."""
        shape = tuple(hi - lo for lo, hi in self.box)
        inner, dims = math.prod(shape), len(shape)
        views = [block[..., :inner, :inner].unflatten(-1, shape).unflatten(-1 - dims, shape)]
        if self.extra:
            views.append(block[..., inner:, :inner].unflatten(-1, shape))
            views.append(block[..., :inner, inner:].unflatten(-2, shape))
            views.append(block[..., inner:, inner:])
        return views

    def gather(self, matrix: Tensor) -> Tensor:
        """A copy of ``matrix (..., n, n)``'s block on this support: ``(..., size, size)``, rows and
        columns in index order."""
        block = matrix.new_empty(*matrix.shape[:-2], self.size, self.size)
        for part, whole in zip(self._block_views(block), self._views(matrix), strict=True):
            part.copy_(whole)
        return block

    def scatter(self, matrix: Tensor, block: Tensor) -> None:
        """Write ``block`` (as from :meth:`gather`) into ``matrix``'s block on this support."""
        for whole, part in zip(self._views(matrix), self._block_views(block), strict=True):
            whole.copy_(part)

    def zero(self, matrix: Tensor) -> None:
        """Zero ``matrix``'s block on this support."""
        for whole in self._views(matrix):
            whole.zero_()


EMPTY_SUPPORT = Support((), ())  # no index: a zero factor


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
        shape = self.storage_shape(dim, groups)
        self.pending = torch.zeros(shape, dtype=dtype, device=device)
        self.pending_rows = 0
        self.pending_support: Support | None = None
        self.running = torch.zeros(shape, dtype=dtype, device=device)
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

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading dimensions of the storage before the factor's own: ``()`` or ``(groups,)``."""
        return () if self.groups == 1 or self.diagonal else (self.groups,)

    def diagonal_of(self, matrix: Tensor) -> Tensor:
        """The diagonal entries of a tensor shaped as this factor's storage."""
        return matrix.diagonal(dim1=-2, dim2=-1)

    def mean_eigenvalue(self) -> float:
        """``tr F / dim`` over all blocks (a host sync; used by the damped inverse's π)."""
        return float(self.diagonal_of(self.running).mean())

    def add_gram(
        self, rows: Tensor, append_ones: bool = False, group: int | None = None, support: Support | None = None
    ) -> None:
        """Accumulate ``rowsᵀ rows`` for ``rows: (R, dim[-1])``, or ``(groups, R, dim[-1])`` per block,
        or into block ``group`` only (a trailing 1 when ``append_ones``).

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
        self._add_row_count(target, rows.shape[-2], rows.sum(dim=-2) if append_ones else None)
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
            target[..., :n, n] += row_sum
            target[..., n, :n] += row_sum
            target[..., n, n] += rows
        self.pending_rows += rows

    def clear_pending(self) -> None:
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
        self.clear_pending()

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
        self.initialized |= finite
        self.discarded += ~finite

    def snapshot(self) -> Factor:
        """A shallow copy holding a copy of ``running``: what a background decomposition reads
        while this factor keeps folding (see ``kfac_optim.background``)."""
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
        self.support = None  # the other ranks' supports are not known here
        self.initialized = ranks > 0
        self.version += 1
        if self.rows_synced is not None:
            self.rows_synced += rows
        self.rows_since_sync = 0

    def adopt(self, decomposition: linalg.Eigen | Tensor | None, shift: float, version: int | None = None) -> None:
        """Hold ``decomposition`` of the running factor at ``version`` (default: the current one),
        computed elsewhere with ``shift`` (None: hold none)."""
        self.decomposition = decomposition
        version = self.version if version is None else version
        self.decomposed_key = None if decomposition is None else (version, shift)

    def state_dict(self) -> dict[str, Any]:
        """The running factor, its health counters and its decomposition (None if none yet)."""
        return {
            "running": self.running,
            "initialized": self.initialized,
            "discarded": self.discarded,
            "version": self.version,
            "rank_bound": self.rank_bound,
            "decomposition": self.decomposition_state(self.decomposition),
            "decomposed_key": self.decomposed_key,
        }

    @staticmethod
    def decomposition_state(decomposition: linalg.Eigen | Tensor | None) -> dict[str, Tensor] | Tensor | None:
        """``decomposition`` as checkpoints hold it: ``{"Q", "d"}`` for an eigendecomposition."""
        if isinstance(decomposition, linalg.Eigen):
            return {"Q": decomposition.Q, "d": decomposition.d}
        return decomposition

    def load_decomposition(self, state: dict[str, Tensor] | Tensor | None) -> linalg.Eigen | Tensor | None:
        """A :meth:`decomposition_state` (validated, :meth:`validate_decomposition`) on this factor's device."""
        device = self.running.device
        if isinstance(state, dict):
            return linalg.Eigen(Q=state["Q"].to(device), d=state["d"].to(device))
        return None if state is None else state.to(device)

    def validate_decomposition(self, decomposition: Any, field: str = "decomposition") -> None:
        """Raise ``ValueError`` naming ``field`` if ``decomposition`` (a :meth:`decomposition_state`)
        is not one of this factor: a tensor shaped as the storage, or ``Q: (..., dim, r)`` and
        ``d: (..., r)``, all finite."""
        if decomposition is None:
            return
        if isinstance(decomposition, dict):
            for key in ("Q", "d"):
                if key not in decomposition:
                    raise ValueError(f"'{field}' has no '{key}'")
            tensors = {f"{field} Q": decomposition["Q"], f"{field} d": decomposition["d"]}
        else:
            tensors = {field: decomposition}
        _check_tensors(tensors)
        if isinstance(decomposition, dict):
            rank = decomposition["Q"].shape[-1]
            expected = {f"{field} Q": (*self.batch_shape, self.dim, rank), f"{field} d": (*self.batch_shape, rank)}
        else:
            expected = {field: self.storage_shape(self.dim, self.groups)}
        _check_shapes(tensors, expected)

    def validate_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming the field if ``state`` is not a usable :meth:`state_dict` of this
        factor: every key present, shapes as this factor's storage (``Q: (..., dim, r)``, ``d: (..., r)``),
        all finite."""
        if not isinstance(state, dict):
            raise ValueError(f"expected a dict, got {type(state).__name__}")
        for key in ("running", "initialized", "discarded", "version", "decomposition", "decomposed_key"):
            if key not in state:
                raise ValueError(f"'{key}' is missing")
        tensors = {"running": state["running"], "initialized": state["initialized"], "discarded": state["discarded"]}
        _check_tensors(tensors)
        self.validate_decomposition(state["decomposition"])
        bound = state.get("rank_bound")
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
            raise ValueError(f"'rank_bound' must be None or an int >= 0, got {bound!r}")
        storage = self.storage_shape(self.dim, self.groups)
        _check_shapes(tensors, {"running": storage, "initialized": (), "discarded": ()})

    def validate_result(self, state: Any) -> None:
        """Raise ``ValueError`` naming the field if ``state`` is not a usable saved result of a background
        decomposition of this factor: ``{"decomposition": a decomposition_state or None (failed),
        "version": the factor version decomposed (int >= 0), "shift": the shift it was given (finite)}``."""
        if not isinstance(state, dict):
            raise ValueError(f"expected a dict, got {type(state).__name__}")
        for key in ("decomposition", "version", "shift"):
            if key not in state:
                raise ValueError(f"'{key}' is missing")
        self.validate_decomposition(state["decomposition"])
        version, shift = state["version"], state["shift"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"'version' must be an int >= 0, got {version!r}")
        if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift):
            raise ValueError(f"'shift' must be a finite float, got {shift!r}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (tensors move to this factor's device and dtypes); the
        caller validates ``state`` first (:meth:`validate_state`)."""
        device, dtype = self.running.device, self.running.dtype
        self.running = state["running"].to(device, dtype, copy=True)
        self.support = None
        self.initialized = state["initialized"].to(device, copy=True)
        self.discarded = state["discarded"].to(device, copy=True)
        self.reported_discards = int(self.discarded)
        self.version = int(state["version"])
        self.rows_synced, self.rows_since_sync = state.get("rank_bound"), 0  # None: saved without one
        decomposition = self.load_decomposition(state["decomposition"])
        self.decomposition = decomposition
        key = state["decomposed_key"]
        self.decomposed_key = None if key is None or decomposition is None else tuple(key)
        self.clear_pending()


def _check_tensors(tensors: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the field of a value that is not a tensor or is non-finite."""
    for field, tensor in tensors.items():
        if not isinstance(tensor, Tensor):
            raise ValueError(f"'{field}' must be a tensor, got {type(tensor).__name__}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"'{field}' is non-finite")


def _check_shapes(tensors: dict[str, Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` naming the field of a tensor not shaped as ``expected`` says."""
    for field, tensor in tensors.items():
        if tuple(tensor.shape) != expected[field]:
            raise ValueError(f"'{field}' has shape {tuple(tensor.shape)}, this model needs {expected[field]}")


class DiagonalFactor(Factor):
    """A diagonal factor stored as its diagonal ``(dim,)`` (e.g. an embedding's ``A``: token
    frequencies), O(dim) memory; statistics are added as per-row sums of squares (or counts)."""

    diagonal = True

    @staticmethod
    def storage_shape(dim: int, groups: int) -> tuple[int, ...]:
        return (dim,)

    def diagonal_of(self, matrix: Tensor) -> Tensor:
        return matrix

    def add_counts(self, counts: Tensor, rows: int) -> None:
        """Add ``counts: (dim,)`` (the diagonal of ``Σ a aᵀ`` over ``rows`` rows) to the pending sum."""
        self.pending += counts
        self.pending_rows += rows

    def add_gram(self, rows: Tensor, append_ones: bool = False) -> None:
        raise TypeError("a diagonal factor takes statistics through add_counts")

    add_column_gram = add_gram


@functools.cache
def _first_forward_parameter(module_type: type[nn.Module]) -> str:
    """The name of ``module_type.forward``'s first parameter after ``self`` (e.g. ``"input"``)."""
    parameters = list(inspect.signature(module_type.forward).parameters)
    return parameters[1]


class KroneckerBlock(ABC):
    """K-FAC block of one module with a ``weight`` (and optional ``bias``) parameter: one Kronecker
    pair ``G ⊗ A`` of the joint weight ``[W | b]``, or ``groups`` independent pairs of its row blocks.

    The extension point of the block registry (``kfac_optim.register_block``): a subclass says
    which module instances it supports (:meth:`unsupported_reason`), which parameters it takes
    (:meth:`create`), its factors (:meth:`make_factors`), and how a captured (input, output-grad)
    pair becomes rows of ``a`` and ``g`` (:meth:`input_rows`, :meth:`output_grad_rows`,
    :meth:`sample_count`, or :meth:`accumulate` whole). The joint gradient is ``(out, in [+1])``,
    or ``(groups, out/groups, in [+1])`` for grouped blocks.
    """

    groups: int = 1

    def __init__(self, name: str, module: nn.Module, include_bias: bool, factor_dtype: torch.dtype) -> None:
        self.name = name
        self.module = module
        weight, bias = self.weight_and_bias(module)
        self.weight: nn.Parameter = weight
        self.bias: nn.Parameter | None = bias if include_bias else None
        self.module_weight: nn.Parameter = weight  # the module's own (``weight`` may become an Apex master)
        self.factors: dict[FactorName, Factor] = self.make_factors(factor_dtype, self.weight.device)
        self.pending_samples = 0
        self._counted_task: int | None = None
        self.failures = 0

    # -- the registry's questions --------------------------------------------------------------

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        """Why this block cannot precondition ``module`` (None: it can). Default: it can."""
        return None

    @classmethod
    def supports(cls, module: nn.Module) -> bool:
        """Whether this block can precondition ``module``."""
        return cls.unsupported_reason(module) is None

    @classmethod
    def weight_and_bias(cls, module: nn.Module) -> tuple[nn.Parameter, nn.Parameter | None]:
        """The parameters this block preconditions: ``module.weight`` and ``module.bias`` by default."""
        return module.weight, getattr(module, "bias", None)

    @classmethod
    def create(
        cls, name: str, module: nn.Module, trainable: set[Tensor], claimed: set[Tensor], factor_dtype: torch.dtype
    ) -> list[KroneckerBlock]:
        """The blocks for ``module`` (a supported one), taking its ``weight`` (and ``bias``) when they
        are ``trainable`` and not yet ``claimed`` by another block; adds what it takes to ``claimed``."""
        weight, bias = cls.weight_and_bias(module)
        if weight not in trainable or weight in claimed:
            return []
        claimed.add(weight)
        include_bias = bias is not None and bias in trainable and bias not in claimed
        if include_bias:
            claimed.add(bias)
        return [cls(name, module, include_bias, factor_dtype)]

    def make_factors(self, dtype: torch.dtype, device: torch.device) -> dict[FactorName, Factor]:
        """Dense ``A: (in [+1], in [+1])`` and ``G: (out, out)`` per group (the default)."""
        out_dim = self.weight.shape[0] // self.groups
        in_dim = math.prod(self.weight.shape[1:]) + (self.bias is not None)
        return {"A": Factor(in_dim, dtype, device, self.groups), "G": Factor(out_dim, dtype, device, self.groups)}

    def install_capture(self, capture: Capture) -> list[RemovableHandle] | None:
        """Hooks of a block that captures its statistics its own way (None: the default forward hook
        on ``module``, handing :meth:`layer_input` and the output's gradient to ``capture.record``).
        Hooks must hold ``capture`` weakly (it dies with its optimizer, and removes them then)."""
        return None

    def captured_modules(self) -> list[nn.Module]:
        """The modules whose forward calls the default capture hooks (``module`` by default; a block
        that also owns another module's uses of its weight adds that module)."""
        return [self.module]

    def layer_input(self, args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module | None = None) -> Any:
        """What a forward of ``module`` (default: ``self.module``) hands to :meth:`accumulate` with its
        output-gradient: its first argument, positional or keyword, detached."""
        if args:
            return args[0].detach()
        module = self.module if module is None else module
        name = _first_forward_parameter(type(module))
        if name not in kwargs:
            raise TypeError(f"K-FAC layer '{self.name}' was called without its input argument '{name}'")
        return kwargs[name].detach()

    def tie(self, name: str, module: nn.Module) -> bool:
        """Take the uses of this block's weight by ``module`` (called ``name``), which shares it (tied
        weights), into the statistics; False (the default): the block cannot, and ``module``'s uses
        are left out of the statistics (the caller warns)."""
        return False

    def describe(self) -> str:
        """One line: the block kind and its factors' shapes and kinds."""
        parts = []
        for name, factor in self.factors.items():
            kind = "diagonal" if factor.diagonal else "dense"
            shape = "x".join(str(d) for d in factor.running.shape)
            parts.append(f"{name} {shape} {kind}")
        params = "weight+bias" if self.bias is not None else "weight"
        return f"{type(self).__name__} ({params}): {', '.join(parts)}"

    def direction_shape(self) -> tuple[int, ...]:
        """Shape of the joint gradient and of the preconditioned direction."""
        return (*self.G.batch_shape, self.G.dim, self.A.dim)

    # -- statistics ------------------------------------------------------------------------------

    @abstractmethod
    def input_rows(self, inputs: Tensor) -> Tensor:
        """The layer input as rows ``(N·R, in)`` without the bias column."""

    def add_input_gram(self, inputs: Tensor, dtype: torch.dtype) -> None:
        """Add the input rows' Gram matrix (with the bias column) to A's pending sum."""
        self.A.add_gram(self.input_rows(inputs).to(dtype), append_ones=self.bias is not None)

    @abstractmethod
    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        """The output-gradient as rows ``(N·R, out)``."""

    def add_output_gram(self, grad_output: Tensor, dtype: torch.dtype) -> None:
        """Add the output-gradient rows' Gram matrix to G's pending sum."""
        self.G.add_gram(self.output_grad_rows(grad_output).to(dtype))

    @abstractmethod
    def sample_count(self, inputs: Tensor) -> int:
        """N, the number of samples in a (possibly unbatched) input."""

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this block preconditions: ``weight`` and, when included, ``bias``."""
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    @property
    def A(self) -> Factor:  # noqa: N802 (the paper's name)
        return self.factors["A"]

    @property
    def G(self) -> Factor:  # noqa: N802
        return self.factors["G"]

    def accumulate(self, inputs: Tensor, grad_output: Tensor) -> None:
        """Add one (input, output-gradient) pair of a forward/backward to the pending sums."""
        dtype = self.A.pending.dtype
        with torch.autocast(inputs.device.type, enabled=False):
            self.add_input_gram(inputs, dtype)
            self.add_output_gram(grad_output, dtype)
        self.count_samples(self.sample_count(inputs))

    def count_samples(self, samples: int) -> None:
        """Add ``samples`` to N, once per backward pass: a module called several times in one
        forward (weight sharing) adds every call's rows but its samples once ("expand",
        Eschenhagen et al. 2023). Outside a backward pass every call counts."""
        task = current_graph_task()
        if task == -1 or task != self._counted_task:
            self.pending_samples += samples
        self._counted_task = task

    def clear_pending(self) -> None:
        for factor in self.factors.values():
            factor.clear_pending()
        self.pending_samples = 0

    def fold(self, decay: float, loss_reduction: str, grad_scale: float | Tensor = 1.0) -> None:
        """Fold pending statistics into the running factors (no-op when none were captured).

        ``grad_scale`` multiplies the captured output-gradients' Gram matrix, e.g. ``scale⁻²``
        for gradients captured under a loss scale.
        """
        if self.pending_samples == 0:
            return
        n = self.pending_samples
        self.A.fold(1.0 / self.A.pending_rows, decay)
        sample_scale = n if loss_reduction == "mean" else 1.0 / n
        self.G.fold(grad_scale * sample_scale, decay)
        self.pending_samples = 0

    def shifts(self, method: Method, damping: float) -> dict[FactorName, float]:
        """Per-factor damping shifts of ``method`` (e.g. none for eigen, ``π√λ`` / ``√λ/π`` for inverse)."""
        a_shift, g_shift = method.shifts(self.A, self.G, damping)
        return {"A": a_shift, "G": g_shift}

    def rank_thresholds(self, method: Method, damping: float) -> dict[FactorName, float | None]:
        """Per-factor eigenvalue thresholds below which the eigen solve treats eigenvalues as 0
        (:func:`linalg.rank_threshold`, from the other factor's trace): for the eigen method on
        two dense ungrouped factors (the solve of ``linalg.eigen_precondition``); None otherwise."""
        a, g = self.A, self.G
        if method.name != "eigen" or a.diagonal or g.diagonal or a.groups > 1 or g.groups > 1:
            return {"A": None, "G": None}
        traces = torch.stack([torch.trace(a.running), torch.trace(g.running)]).tolist()
        return {"A": linalg.rank_threshold(damping, traces[1]), "G": linalg.rank_threshold(damping, traces[0])}

    def grad_matrix(self) -> Tensor | None:
        """The joint gradient ``[∇W | ∇b]`` (see :meth:`direction_shape`), or None if ``W`` has no grad."""
        weight_grad = self.weight.grad
        if weight_grad is None:
            return None
        bias_grad = None
        if self.bias is not None:
            bias_grad = self.bias.grad if self.bias.grad is not None else torch.zeros_like(self.bias)
        return self.joint_gradient(weight_grad, bias_grad)

    def joint_gradient(self, weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
        """The joint gradient (see :meth:`direction_shape`) of whole gradients shaped as ``weight``
        and ``bias`` (``bias_grad`` given exactly when the block includes the bias); the inverse of
        :meth:`split`. The FSDP2 path calls it on gradients gathered from their shards."""
        matrix = weight_grad.reshape(*self.G.batch_shape, self.G.dim, -1)
        if bias_grad is None:
            return matrix
        return torch.cat([matrix, bias_grad.reshape(*matrix.shape[:-1], 1)], dim=-1)

    def precondition(self, grad: Tensor, method: Method, damping: float) -> Tensor | None:
        """The preconditioned joint direction, or None before any decomposition."""
        a, g = self.A.decomposition, self.G.decomposition
        if a is None or g is None:
            return None
        dtype = a.d.dtype if isinstance(a, linalg.Eigen) else a.dtype
        return method.precondition(grad.to(dtype), self.A, self.G, damping)

    def split(self, direction: Tensor) -> list[tuple[nn.Parameter, Tensor]]:
        """Cut a joint direction (see :meth:`direction_shape`) into per-parameter directions."""
        weight_part = direction[..., : direction.shape[-1] - (self.bias is not None)]
        pieces = [(self.weight, weight_part.reshape(self.weight.shape).to(self.weight.dtype))]
        if self.bias is not None:
            pieces.append((self.bias, direction[..., -1].reshape(self.bias.shape).to(self.bias.dtype).contiguous()))
        return pieces

    def state_dict(self) -> dict[str, Any]:
        return {"factors": {name: factor.state_dict() for name, factor in self.factors.items()}, "failures": self.failures}

    def validate_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming the layer, factor and field if ``state`` (a :meth:`state_dict`)
        does not fit this block; nothing is modified."""
        where = f"K-FAC checkpoint, layer '{self.name}'"
        if not isinstance(state, dict) or not isinstance(state.get("factors"), dict) or "failures" not in state:
            raise ValueError(f"{where}: expected a dict with 'factors' and 'failures'")
        for name, factor in self.factors.items():
            if name not in state["factors"]:
                raise ValueError(f"{where}, factor {name}: missing")
            try:
                factor.validate_state(state["factors"][name])
            except ValueError as error:
                raise ValueError(f"{where}, factor {name}: {error}") from None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, factor in self.factors.items():
            factor.load_state_dict(state["factors"][name])
        self.failures = int(state["failures"])
        self.clear_pending()
