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

import functools
import inspect
import logging
import math
from abc import ABC, abstractmethod
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from kfac_optim import linalg

logger = logging.getLogger(__name__)

FactorName = Literal["A", "G"]
Method = Literal["eigen", "inverse"]


class Factor:
    """One symmetric Kronecker factor ``(dim, dim)``: pending sum, running average, decomposition.

    The running average only changes through device-side selects, so folding a batch needs no
    host sync: a non-finite batch leaves the factor as it was and counts one discard.
    """

    def __init__(self, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dim = dim
        self.pending = torch.zeros(dim, dim, dtype=dtype, device=device)
        self.pending_rows = 0
        self.running = torch.zeros(dim, dim, dtype=dtype, device=device)
        self.initialized = torch.zeros((), dtype=torch.bool, device=device)
        self.discarded = torch.zeros((), dtype=torch.int64, device=device)
        self.reported_discards = 0
        self.version = 0
        self.decomposition: linalg.Eigen | Tensor | None = None
        self.decomposed_key: tuple[int, float] | None = None

    def add_gram(self, rows: Tensor, append_ones: bool = False) -> None:
        """Accumulate ``rowsᵀ rows`` for ``rows: (R, dim[-1])`` (a trailing 1 when ``append_ones``)."""
        n = rows.shape[1]
        linalg.add_gram_(self.pending[:n, :n], rows)
        self._add_row_count(rows.shape[0], rows.sum(dim=0) if append_ones else None)

    def add_column_gram(self, columns: Tensor, append_ones: bool = False) -> None:
        """As :meth:`add_gram` for the ``B·L`` rows ``columns[b, :, l]`` of ``columns: (B, dim[-1], L)``."""
        n = columns.shape[1]
        linalg.add_column_gram_(self.pending[:n, :n], columns)
        rows = columns.shape[0] * columns.shape[2]
        self._add_row_count(rows, columns.sum(dim=(0, 2)) if append_ones else None)

    def _add_row_count(self, rows: int, row_sum: Tensor | None) -> None:
        """Count ``rows`` more rows; with a bias, add their sum and count to the trailing row/column."""
        if row_sum is not None:
            n = len(row_sum)
            self.pending[:n, n] += row_sum
            self.pending[n, :n] += row_sum
            self.pending[n, n] += rows
        self.pending_rows += rows

    def clear_pending(self) -> None:
        """Forget the pending statistics. ``pending`` is all zeros whenever ``pending_rows == 0``,
        so a factor that accumulated nothing (every non-factor step) costs no n² pass."""
        if self.pending_rows:
            self.pending.zero_()
            self.pending_rows = 0

    def fold(self, scale: float | Tensor, decay: float) -> None:
        """``F ← decay·F + (1−decay)·scale·pending`` (``F ← scale·pending`` on the first fold).

        A non-finite batch leaves ``F`` as it was (one discard counted); a non-finite ``F``
        (however it got there) is reset to the batch instead of being averaged into.
        """
        # In place, no n×n temporaries (fresh CPU pages cost more than the arithmetic; isfinite
        # and where are slow on CPU): F ← F + w·(batch − F) with w = 1 − decay once initialized,
        # 1 before or when F is not finite (exactly batch: non-finite entries of F are zeroed first),
        # 0 for a non-finite batch (zeroed first so 0·nan cannot leak). F and the batch are sums of
        # Gram matrices, finite iff their diagonal is (|F_ij| ≤ √(F_ii F_jj)): O(n) checks.
        batch = self.pending.mul_(scale)
        finite = torch.isfinite(batch.diagonal().sum())
        keep_running = self.initialized & torch.isfinite(self.running.diagonal().sum())
        weight = finite.to(batch.dtype) * (1 - keep_running.to(batch.dtype) * decay)
        self.running.nan_to_num_(0.0, 0.0, 0.0).lerp_(batch.nan_to_num_(0.0, 0.0, 0.0), weight)
        self.initialized |= finite
        self.discarded += ~finite
        self.version += 1
        self.clear_pending()

    def decompose(self, method: Method, shift: float, dtype: torch.dtype) -> bool:
        """Refresh the decomposition unless the factor and shift are unchanged since the last one.

        ``eigen``: ``Q diag(d) Qᵀ`` (the shift is applied at preconditioning time);
        ``inverse``: ``(F + shift·I)⁻¹``. Returns False when it failed (the old one is kept).
        """
        key = (self.version, shift if method == "inverse" else 0.0)
        if key == self.decomposed_key:
            return True
        if method == "eigen":
            result = linalg.symmetric_eigen(self.running, dtype)
        else:
            result = linalg.damped_inverse(self.running, shift, dtype)
        if result is None:
            return False
        self.decomposition = result
        self.decomposed_key = key
        return True

    def set_global(self, total: Tensor, ranks: Tensor) -> None:
        """Become the mean of several ranks' running factors (distributed training).

        ``total``: ``(dim, dim)``, the sum of the ranks' running factors, where a rank whose
        factor is not initialized contributed zeros; ``ranks``: 0-dim, how many were initialized.
        The result is initialized if any was, and counts as a new version of the factor.
        """
        self.running = total.div_(ranks.clamp(min=1))
        self.initialized = ranks > 0
        self.version += 1

    def adopt(self, decomposition: linalg.Eigen | Tensor | None, shift: float) -> None:
        """Hold ``decomposition`` of the current running factor, computed elsewhere with ``shift``
        (None: hold none)."""
        self.decomposition = decomposition
        self.decomposed_key = None if decomposition is None else (self.version, shift)


    def state_dict(self) -> dict[str, Any]:
        """The running factor, its health counters and its decomposition (None if none yet)."""
        decomposition = self.decomposition
        if isinstance(decomposition, linalg.Eigen):
            decomposition = {"Q": decomposition.Q, "d": decomposition.d}
        return {
            "running": self.running,
            "initialized": self.initialized,
            "discarded": self.discarded,
            "version": self.version,
            "decomposition": decomposition,
            "decomposed_key": self.decomposed_key,
        }

    def validate_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming the field if ``state`` is not a usable :meth:`state_dict` of this
        factor: every key present, shapes ``(dim, dim)`` (``Q: (dim, r)``, ``d: (r,)``), all finite."""
        if not isinstance(state, dict):
            raise ValueError(f"expected a dict, got {type(state).__name__}")
        for key in ("running", "initialized", "discarded", "version", "decomposition", "decomposed_key"):
            if key not in state:
                raise ValueError(f"'{key}' is missing")
        tensors = {"running": state["running"], "initialized": state["initialized"], "discarded": state["discarded"]}
        decomposition = state["decomposition"]
        if isinstance(decomposition, dict):
            for key in ("Q", "d"):
                if key not in decomposition:
                    raise ValueError(f"'decomposition' has no '{key}'")
            tensors.update({"decomposition Q": decomposition["Q"], "decomposition d": decomposition["d"]})
        elif decomposition is not None:
            tensors["decomposition"] = decomposition
        for field, tensor in tensors.items():
            if not isinstance(tensor, Tensor):
                raise ValueError(f"'{field}' must be a tensor, got {type(tensor).__name__}")
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ValueError(f"'{field}' is non-finite")
        square = (self.dim, self.dim)
        expected = {"running": square, "initialized": (), "discarded": (), "decomposition": square}
        if isinstance(decomposition, dict):
            rank = decomposition["Q"].shape[-1]
            expected.update({"decomposition Q": (self.dim, rank), "decomposition d": (rank,)})
        for field, tensor in tensors.items():
            if tuple(tensor.shape) != expected[field]:
                raise ValueError(f"'{field}' has shape {tuple(tensor.shape)}, this model needs {expected[field]}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` (tensors move to this factor's device and dtypes); the
        caller validates ``state`` first (:meth:`validate_state`)."""
        device, dtype = self.running.device, self.running.dtype
        self.running = state["running"].to(device, dtype, copy=True)
        self.initialized = state["initialized"].to(device, copy=True)
        self.discarded = state["discarded"].to(device, copy=True)
        self.reported_discards = int(self.discarded)
        self.version = int(state["version"])
        decomposition = state["decomposition"]
        if isinstance(decomposition, dict):
            decomposition = linalg.Eigen(Q=decomposition["Q"].to(device), d=decomposition["d"].to(device))
        elif decomposition is not None:
            decomposition = decomposition.to(device)
        self.decomposition = decomposition
        key = state["decomposed_key"]
        self.decomposed_key = None if key is None or decomposition is None else tuple(key)
        self.clear_pending()


@functools.cache
def _first_forward_parameter(module_type: type[nn.Module]) -> str:
    """The name of ``module_type.forward``'s first parameter after ``self`` (e.g. ``"input"``)."""
    parameters = list(inspect.signature(module_type.forward).parameters)
    return parameters[1]


class KroneckerBlock(ABC):
    """K-FAC block of one module with a ``weight`` (and optional ``bias``) parameter."""

    def __init__(self, name: str, module: nn.Module, include_bias: bool, factor_dtype: torch.dtype) -> None:
        self.name = name
        self.module = module
        self.weight: nn.Parameter = module.weight
        self.bias: nn.Parameter | None = module.bias if include_bias else None
        out_dim = self.weight.shape[0]
        in_dim = math.prod(self.weight.shape[1:]) + (self.bias is not None)
        device = self.weight.device
        self.factors: dict[FactorName, Factor] = {
            "A": Factor(in_dim, factor_dtype, device),
            "G": Factor(out_dim, factor_dtype, device),
        }
        self.pending_samples = 0
        self.failures = 0

    def layer_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        """The tensor the statistics come from: the forward's first argument, positional or keyword."""
        if args:
            return args[0]
        name = _first_forward_parameter(type(self.module))
        if name not in kwargs:
            raise TypeError(f"K-FAC layer '{self.name}' was called without its input argument '{name}'")
        return kwargs[name]

    @abstractmethod
    def input_rows(self, inputs: Tensor) -> Tensor:
        """The layer input as rows ``(N·R, in)`` without the bias column."""

    def add_input_gram(self, inputs: Tensor, dtype: torch.dtype) -> None:
        """Add the input rows' Gram matrix (with the bias column) to A's pending sum."""
        self.A.add_gram(self.input_rows(inputs).to(dtype), append_ones=self.bias is not None)

    @abstractmethod
    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        """The output-gradient as rows ``(N·R, out)``."""

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
            self.G.add_gram(self.output_grad_rows(grad_output).to(dtype))
        self.pending_samples += self.sample_count(inputs)

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
        """Per-factor damping shifts: none for eigen (exact damping), ``π√λ`` / ``√λ/π`` for inverse."""
        if method == "eigen":
            return {"A": 0.0, "G": 0.0}
        pi = linalg.pi_correction(self.A.running, self.G.running)
        root = damping**0.5
        return {"A": pi * root, "G": root / pi}

    def grad_matrix(self) -> Tensor | None:
        """The joint gradient ``[∇W | ∇b]``: ``(out, in [+1])``, or None if ``W`` has no grad.

        For parameters sharded by FSDP2 (``DTensor``s) these are this rank's rows of it.
        """
        weight_grad = self.weight.grad
        if weight_grad is None:
            return None
        weight_grad = _local(weight_grad)
        matrix = weight_grad.reshape(weight_grad.shape[0], math.prod(weight_grad.shape[1:]))
        if self.bias is None:
            return matrix
        bias_grad = _local(self.bias.grad) if self.bias.grad is not None else matrix.new_zeros(len(matrix))
        return torch.cat([matrix, bias_grad.unsqueeze(1)], dim=1)

    def precondition(self, grad: Tensor, method: Method, damping: float) -> Tensor | None:
        """The preconditioned ``(out, in [+1])`` direction, or None before any decomposition."""
        a, g = self.A.decomposition, self.G.decomposition
        if a is None or g is None:
            return None
        work = grad.to(a.Q.dtype if isinstance(a, linalg.Eigen) else a.dtype)
        if isinstance(a, linalg.Eigen):
            return linalg.eigen_precondition(work, a, g, damping)
        return linalg.inverse_precondition(work, a, g)

    def split(self, direction: Tensor) -> list[tuple[nn.Parameter, Tensor]]:
        """Cut a joint ``(rows, in [+1])`` direction into per-parameter directions of ``rows`` rows
        (all of them, or this rank's rows of FSDP2-sharded parameters)."""
        weight_part = direction[:, : math.prod(self.weight.shape[1:])]
        pieces = [(self.weight, weight_part.reshape(len(direction), *self.weight.shape[1:]).to(self.weight.dtype))]
        if self.bias is not None:
            pieces.append((self.bias, direction[:, -1].to(self.bias.dtype).contiguous()))
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
        self.pending_samples = 0


def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor`` (an FSDP2 gradient), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
