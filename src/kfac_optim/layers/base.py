"""One Kronecker block: a layer's two factors, their statistics and its preconditioner.

Owns: :class:`KroneckerBlock`, the extension point of the block registry: which module instances
a block supports and which parameters it takes (a bias frozen while the weight trains is left
out: ``bias=False``'s block), allocating its factors (at once, or on first use for a layer frozen
at construction), turning captured (input, output-gradient) pairs
into its factors' pending statistics and folding them, the block's weight-sharing support, and
turning a layer's gradient into the preconditioned direction; :class:`Capture`, what a block that
installs its own hooks may ask of the statistics capture.
Must not know: the hooks themselves (``capture``, ``layers.hooks``), param groups, ranks, loss
scaling (callers pass plain scales), which method is used (it asks the ``Method`` it is handed).

Conventions: ``layers.factor`` (docs/numerics.md). The joint weight ``[W | b]`` is
``(out, in [+1])``, or ``(groups, out/groups, in [+1])`` for a block of ``groups`` independent pairs.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Literal, Protocol

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfac_optim.diagnostics import warn_user
from kfac_optim.layers.factor import Factor, FactorName, output_gram_scale
from kfac_optim.layers.hooks import current_call_samples, current_samples
from kfac_optim.layers.positions import RealPositions
from kfac_optim.methods import Method
from kfac_optim.state import within

logger = logging.getLogger(__name__)

WeightSharing = Literal["expand", "reduce"]


class Capture(Protocol):
    """What a block that installs its own hooks needs from the statistics capture."""

    def should_capture(self, module: nn.Module) -> bool:
        """Whether a forward of ``module`` now should record statistics."""

    def site(self, block: KroneckerBlock, rebuild: Callable[[Tensor], Any]) -> Any:
        """A place where compiled forwards tap ``block``'s output, for :meth:`tap` (create it once,
        with the hooks); ``rebuild`` turns the layer input's tensor into what ``accumulate`` takes."""

    def tap(self, block: KroneckerBlock, layer_input: Any, output: Tensor, site: Any = None) -> Tensor | None:
        """Record ``(layer_input, output's gradient)`` for ``block`` when that gradient arrives
        (``output`` must require grad). While ``torch.compile`` traces the forward and a ``site`` is
        given, returns the output to use in place of ``output`` (tapped in the traced graph); else None."""


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
    supports_weight_sharing: ClassVar[bool] = False
    """Whether the block implements ``weight_sharing="reduce"`` (its statistics read :attr:`reduce`:
    one row per sample for a weight applied at several positions, Eschenhagen et al. 2023). A
    block that does not keeps "expand" and says so in :meth:`describe` (:meth:`set_weight_sharing`)."""
    reduce: bool = False
    """Set by :meth:`set_weight_sharing`: "reduce" (True) or "expand" (False)."""
    ignored_weight_sharing: WeightSharing | None = None
    """The mode asked of :meth:`set_weight_sharing` that this block does not implement (None: none)."""
    sgd_reason: str | None = None
    """Set by :meth:`leave_to_sgd`: the block records nothing and its parameters take the SGD path."""
    takes_nested: ClassVar[bool] = False
    """Whether the block records a nested jagged input (``torch.nested``, ``layout=torch.jagged``);
    the capture refuses one for a block that does not, naming the layer."""

    @property
    def counts_own_batch(self) -> bool:
        """Whether the block counts the samples of its own input rather than the model call's N
        (:meth:`count_samples`): False, except where the layer knows its batch is not the model
        input's dim 0 (a sequence-first ``nn.MultiheadAttention``)."""
        return False

    def __init__(self, name: str, module: nn.Module, include_bias: bool, factor_dtype: torch.dtype) -> None:
        self.name = name
        self.module = module
        weight, bias = self.weight_and_bias(module)
        self.weight: nn.Parameter = weight
        self.bias: nn.Parameter | None = bias if include_bias else None
        self.module_weight: nn.Parameter = weight  # the module's own (``weight`` may become an Apex master)
        self.factors: dict[FactorName, Factor] = self.make_factors(factor_dtype, self.weight.device)
        if not self.frozen:  # a frozen layer's factors are allocated when it first records (Factor.allocated)
            for factor in self.factors.values():
                factor.allocate()
        self.frozen_bias: nn.Parameter | None = None
        """The module's bias when it was left out because it was frozen while the weight trained (see
        :meth:`create`)."""
        self.pending_samples = 0
        self._counted: set[tuple[int, int]] = set()  # the (graph task, model call)s counted since the last fold
        self.calls = [0, 0]  # calls recorded since the last fold, and how many of them held one sample
        self._warned_mask = False
        self.failures = 0
        self.method_state: dict[str, Tensor] = {}
        """Per-block state of a stateful ``Method`` (e.g. ``EigenAdam``'s second moments); saved with the block."""

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
        if isinstance(weight, nn.parameter.UninitializedParameter):
            raise ValueError(
                f"K-FAC layer '{name}' ({type(module).__name__}) has uninitialized (lazy) parameters, so K-FAC cannot "
                "size its factors: run one forward pass (e.g. on a sample batch) before creating KFAC, or pass "
                f"curvature=CurvatureConfig(skip_layers=[{name!r}]) to leave it to SGD"
            )
        claimed.add(weight)
        include_bias = bias is not None and bias in trainable and bias not in claimed
        # A bias frozen while the weight trains: the block is the one of bias=False (A without the
        # trailing 1), so the weight's step is bias=False's. A layer frozen whole keeps its bias for
        # when it is unfrozen.
        left_out = include_bias and not bias.requires_grad and weight.requires_grad
        if include_bias and not left_out:
            claimed.add(bias)
        block = cls(name, module, include_bias and not left_out, factor_dtype)
        if left_out:
            block.frozen_bias = bias
        return [block]

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

    def set_weight_sharing(self, mode: WeightSharing) -> bool:
        """Use ``mode`` for a weight applied at several positions of a sample ("expand": every use is
        a row; "reduce": one row per sample). False when the block does not implement "reduce"
        (:attr:`supports_weight_sharing`): it keeps "expand", and :meth:`describe` names it."""
        if mode == "reduce" and not self.supports_weight_sharing:
            self.ignored_weight_sharing = mode
            return False
        self.reduce = mode == "reduce"
        self.ignored_weight_sharing = None
        return True

    @property
    def frozen(self) -> bool:
        """Whether the block's weight has ``requires_grad=False`` now: the block records nothing (its
        statistics are captured for the weight's gradient) and preconditions nothing (it goes by the
        weight's gradient, :meth:`grad_matrix`); a bias that trains then takes the SGD path."""
        return not self.module_weight.requires_grad

    @property
    def has_statistics(self) -> bool:
        """Whether statistics were ever folded into the factors (or restored with them): a block
        without has no decomposition, so its parameters take the SGD path. Host counters, no sync."""
        return any(factor.version > 0 for factor in self.factors.values())

    def leave_to_sgd(self, reason: str) -> None:
        """Record nothing from now on (the block's parameters take the SGD path: its factors are
        never initialized, so it never has a decomposition), for ``reason`` (in :meth:`describe`)."""
        self.sgd_reason = reason
        self.discard_pending()

    def mask_of(self, layer_input: Any, positions: RealPositions) -> RealPositions | None:
        """The real positions of a call recorded under ``KFAC.mask`` (``layers.positions``), fitted
        to ``layer_input``, or None: the call is recorded whole. This default (a block that does not
        implement masks) records every position and warns once."""
        self.warn_unmasked("its block kind does not implement masks")
        return None

    def warn_unmasked(self, reason: str) -> None:
        """Warn once that a call under ``KFAC.mask`` is recorded with every position, for ``reason``."""
        if not self._warned_mask:
            self._warned_mask = True
            warn_user(f"K-FAC layer '{self.name}' ({type(self).__name__}) was called under a padding mask "
                      f"(KFAC.mask() or the model's attention_mask) but counts every position in its statistics: "
                      f"{reason}", RuntimeWarning)

    def parameters_text(self) -> str:
        """Which parameters the block holds and what happens to them now, e.g. ``"weight+bias"``."""
        if self.bias is None:
            if self.frozen_bias is None:
                return "weight"
            return ("weight; its bias was frozen when KFAC was built, so the block is bias=False's "
                    "(A without the bias column)")
        weight, bias = self.weight.requires_grad, self.bias.requires_grad
        if weight and not bias:
            return ("weight+bias; the bias is frozen now: the weight is still preconditioned with the joint "
                    "[W | b] factors (freeze the bias before building KFAC for bias=False's block)")
        if bias and not weight:
            return ("weight+bias; the weight is frozen now: the block records and preconditions nothing (it goes "
                    "by the weight's gradient) and the bias takes the SGD path")
        return "weight+bias"

    def describe(self) -> str:
        """One line: the block kind, its parameters now (:meth:`parameters_text`) and its factors'
        shapes and kinds (whether allocated)."""
        parts = ", ".join(f"{name} {factor.describe()}" for name, factor in self.factors.items())
        text = f"{type(self).__name__} ({self.parameters_text()}): {parts}"
        if self.ignored_weight_sharing is not None:
            text += (f"; weight_sharing={self.ignored_weight_sharing!r} not implemented by {type(self).__name__}: "
                     "every use of the weight is a row ('expand')")
        if self.sgd_reason is not None:
            text += f"; takes the SGD path: {self.sgd_reason}"
        return text

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

    def forward_rows(self) -> int:
        """The input rows the layer's forward multiplied with its weight in the captures since the
        last fold (what a step's forward and backward cost is counted from, ``kfac_optim.schedule.costs``):
        ``A``'s pending rows by default; a block whose statistics make fewer rows than its
        forward multiplies (a conv's ``Reduce``) counts the forward's."""
        return self.A.pending_rows

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this block preconditions: ``weight`` and, when included, ``bias``."""
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def has_gradient(self) -> bool:
        """Whether a parameter of this block (or the module's own weight) holds a ``.grad``: the
        gradient that pending statistics belong to (``module.zero_grad()`` discards it)."""
        return self.module_weight.grad is not None or any(p.grad is not None for p in self.parameters())

    @property
    def A(self) -> Factor:  # noqa: N802 (the paper's name)
        return self.factors["A"]

    @property
    def G(self) -> Factor:  # noqa: N802
        return self.factors["G"]

    def accumulate(self, inputs: Tensor, grad_output: Tensor) -> None:
        """Add one (input, output-gradient) pair of a forward/backward to the pending sums."""
        dtype = self.A.dtype
        with torch.autocast(inputs.device.type, enabled=False):
            self.add_input_gram(inputs, dtype)
            self.add_output_gram(grad_output, dtype)
        self.count_samples(self.sample_count(inputs))

    def count_samples(self, samples: int) -> None:
        """Add one call's samples to N, once per backward pass and call of the model
        (:func:`~kfac_optim.layers.hooks.current_samples`): a module called several times within one
        forward of the model (weight sharing: an RNN cell over time steps, an encoder run on chunks)
        adds every call's rows but the samples once ("expand", Eschenhagen et al. 2023); calls from
        separate calls of the model (chunks of one batch) hold different samples and each counts.
        The samples are the model call's N (:func:`~kfac_optim.layers.hooks.current_call_samples`,
        docs/numerics.md, "What N is"), the same for every block; ``samples``, the layer input's own
        count, only where that N is unknown or the block :attr:`counts_own_batch`. Outside a
        backward pass every call counts. Also counts the call, and whether its layer input held one
        sample while the model's input held several rows, for ``batch_free``."""
        key = current_samples()
        call_samples, call_rows = current_call_samples()
        if key[0] == -1 or key not in self._counted:
            self.pending_samples += samples if call_samples is None or self.counts_own_batch else call_samples
            if key[0] != -1:
                self._counted.add(key)
        self.calls[0] += 1
        self.calls[1] += samples == 1 and call_rows != 1

    def discard_pending(self) -> None:
        for factor in self.factors.values():
            factor.discard_pending()
        self.forget_samples()

    def forget_samples(self) -> None:
        """Forget the samples and calls counted since the last fold (after a fold or a discard)."""
        self.pending_samples = 0
        self._counted.clear()
        self.calls = [0, 0]

    def fold(self, decay: float, loss_reduction: str, grad_scale: float | Tensor = 1.0) -> None:
        """Fold pending statistics into the running factors (no-op when none were captured).

        ``grad_scale`` multiplies the captured output-gradients' Gram matrix, e.g. ``scale⁻²``
        for gradients captured under a loss scale.
        """
        if self.pending_samples == 0:
            return
        self.A.fold(1.0 / self.A.pending_rows, decay)
        self.G.fold(output_gram_scale(self.pending_samples, loss_reduction, grad_scale), decay)
        self.forget_samples()

    def factors_to_reduce(self) -> list[Factor]:
        """The factors whose running averages the ranks average in the lazy factor reduction
        (``distributed/data_parallel.py``): ``A``, ``G``; a block whose ``A``, ``G`` are derived from other
        factors (a tied weight, ``layers.embedding``) names those and recomputes ``A``, ``G`` in
        :meth:`after_factor_reduction`."""
        return [self.A, self.G]

    def after_factor_reduction(self) -> None:  # noqa: B027 (an optional hook: does nothing unless a block derives A, G)
        """Called after the reduction replaced :meth:`factors_to_reduce` by the ranks' average."""

    def shifts(self, method: Method, damping: float) -> dict[FactorName, float]:
        """Per-factor damping shifts of ``method`` (e.g. none for eigen, ``π√λ`` / ``√λ/π`` for inverse)."""
        a_shift, g_shift = method.shifts(self.A, self.G, damping)
        return {"A": a_shift, "G": g_shift}

    def rank_thresholds(self, method: Method, damping: float) -> dict[FactorName, float | None]:
        """Per-factor eigenvalue thresholds below which ``method``'s decomposition may treat
        eigenvalues as 0 (None: none; :meth:`Method.rank_thresholds`)."""
        a_threshold, g_threshold = method.rank_thresholds(self.A, self.G, damping)
        return {"A": a_threshold, "G": g_threshold}

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
        """The preconditioned joint direction (in the dtype of ``A``'s decomposition: its last tensor,
        e.g. the eigenvalues), or None before any decomposition."""
        if self.A.decomposition is None or self.G.decomposition is None:
            return None
        dtype = method.decomposer.tensors(self.A)[-1].dtype
        return method.precondition(grad.to(dtype), self.A, self.G, damping, self.method_state)

    def split(self, direction: Tensor) -> list[tuple[nn.Parameter, Tensor]]:
        """Cut a joint direction (see :meth:`direction_shape`) into per-parameter directions."""
        weight_part = direction[..., : direction.shape[-1] - (self.bias is not None)]
        pieces = [(self.weight, self.weight_direction(weight_part).to(self.weight.dtype))]
        if self.bias is not None:
            pieces.append((self.bias, direction[..., -1].reshape(self.bias.shape).to(self.bias.dtype).contiguous()))
        return pieces

    def weight_direction(self, matrix: Tensor) -> Tensor:
        """The weight's columns of a joint direction, ``(*groups, out, in)``, as a tensor shaped as
        ``weight`` (a reshape by default: the weight is stored output-first)."""
        return matrix.reshape(self.weight.shape)

    def state_dict(self, method: Method | None = None) -> dict[str, Any]:
        """The factors' states (their decompositions as ``method``'s decomposer saves them), the
        failure count and a stateful method's per-block tensors."""
        state: dict[str, Any] = {"factors": {name: factor.state_dict(method) for name, factor in self.factors.items()},
                                 "failures": self.failures}
        if self.method_state:  # a stateful method's tensors (absent otherwise, as in older checkpoints)
            state["method_state"] = {key: value.clone() for key, value in self.method_state.items()}
        return state

    def check_state(self, state: Any, method: Method | None = None) -> None:
        """Raise ``ValueError`` naming the factor and field if ``state`` (a :meth:`state_dict`) does
        not fit this block (its decompositions ``method``'s); nothing is changed."""
        if not isinstance(state, dict) or not isinstance(state.get("factors"), dict) or "failures" not in state:
            raise ValueError("expected a dict with 'factors' and 'failures'")
        for name, factor in self.factors.items():
            with within(f"factor {name}"):
                if name not in state["factors"]:
                    raise ValueError("missing")
                factor.check_state(state["factors"][name], method)
        method_state = state.get("method_state", {})
        if not isinstance(method_state, dict) or not all(isinstance(v, Tensor) for v in method_state.values()):
            raise ValueError("'method_state' must be a dict of tensors")

    def load_state_dict(self, state: dict[str, Any], method: Method | None = None) -> None:
        """Restore a checked :meth:`state_dict` (decompositions read by ``method``'s decomposer)."""
        for name, factor in self.factors.items():
            factor.load_state_dict(state["factors"][name], method)
        self.failures = int(state["failures"])
        device = self.weight.device
        self.method_state = {key: value.to(device, copy=True) for key, value in state.get("method_state", {}).items()}
        self.discard_pending()
