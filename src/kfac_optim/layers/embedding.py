"""K-FAC block for ``nn.Embedding``: ``nn.Linear(V, D, bias=False)`` on one-hot rows, weight transposed.

With one-hot inputs ``a`` the factor ``A = (1/(N·R)) Σ a aᵀ`` is diagonal: the tokens' frequencies,
held as a vector ``(V,)`` (O(V) memory, never a ``V x V`` matrix). ``G = (1/N) Σ ĝ ĝᵀ`` is dense
``(D, D)`` from the output-gradient rows. The joint gradient is ``∇Wᵀ: (D, V)``.

Defined behaviour:
- ``padding_idx``: a padding position counts as a row whose ``a`` and ``ĝ`` are zero (the layer
  gives its weight no gradient), so it adds nothing to either factor but is counted in ``R``
  (no host sync to count it out); the padding row's gradient is zero and stays zero preconditioned.
- ``max_norm``: the layer renormalises rows in place before the lookup; the statistics do not
  depend on the weight, and the gradient is preconditioned as it comes.
- ``sparse=True``: not supported (the gradient is a sparse tensor); the layer takes the SGD path,
  which ``KFAC.describe()`` reports.

Tied weights (``head.weight = embedding.weight`` for an ``nn.Linear(D, V)`` head after the
embedding; docs/numerics.md, "Tied weights"): the block also captures the head; each of the four
use factors keeps its own running average (:class:`TiedHead`), and the block's ``A (V,)`` and
``G (D, D)`` are the Kronecker product nearest in Frobenius norm to the sum of the two uses
(``linalg.nearest_kronecker_sum``), recomputed after every fold and after the ranks average the
use factors (:meth:`EmbeddingBlock.factors_to_reduce`). Indices without a batch dimension
(``position(torch.arange(T))``): :attr:`EmbeddingBlock.unbatched` counts their calls and rows for
:mod:`kfac_optim.capture.batch_free`, which turns such blocks to the SGD path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim import linalg
from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.factor import DiagonalFactor, Factor, FactorName, output_gram_scale
from kfac_optim.layers.hooks import current_mask
from kfac_optim.layers.positions import RealPositions
from kfac_optim.methods import Method
from kfac_optim.state import within


class TiedHead:
    """A Linear head sharing an embedding's weight ``(V, D)`` and the statistics of both uses, each
    a factor with its own pending sum and running average: the embedding's ``embedding_A: (V,)``
    (token counts) and ``embedding_G: (D, D)``; the head's ``head_A: (D, D)`` (``Σ a aᵀ``) and
    ``head_G: (V,)`` (``Σ ĝ²``, the diagonal of ``Σ ĝ ĝᵀ``)."""

    def __init__(self, name: str, module: nn.Linear, dtype: torch.dtype) -> None:
        self.name = name
        self.module = module
        vocabulary, dim = module.weight.shape
        device = module.weight.device
        self.embedding_A = DiagonalFactor(vocabulary, dtype, device)
        self.embedding_G = Factor(dim, dtype, device)
        self.head_A = Factor(dim, dtype, device)
        self.head_G = DiagonalFactor(vocabulary, dtype, device)

    def factors(self) -> dict[str, Factor]:
        """The four use factors by name, in the order the ranks average them."""
        return {"embedding_A": self.embedding_A, "embedding_G": self.embedding_G,
                "head_A": self.head_A, "head_G": self.head_G}

    def add(self, inputs: Tensor, grad_output: Tensor, reduce: bool, positions: RealPositions | None = None) -> None:
        """Add one head call's rows: every position (expand), or per sample the mean input and the
        summed output-gradient over its positions (``reduce``, inputs ``(N, *, D)`` with positions);
        with ``positions`` (``KFAC.mask`` fitted to the input's leading dims) the real ones only."""
        a, g = inputs.to(self.head_A.pending.dtype), grad_output.to(self.head_A.pending.dtype)
        real = None
        if positions is not None:
            a, g, real = positions.keep(a), positions.keep(g), positions.count
        if reduce and a.dim() > 2:
            a = a.reshape(a.shape[0], -1, a.shape[-1])
            if positions is None:
                a = a.mean(1)
            else:  # the mean over the sample's real positions
                a = a.sum(1) / positions.mask.reshape(a.shape[0], -1).sum(1, keepdim=True).clamp(min=1)
            g = g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)
            real = None
        a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        rows = a.shape[0] if real is None else real
        self.head_A.add_gram(a, count=rows)
        self.head_G.add_counts(g.square().sum(0), rows)

    def fold(self, g_scale: float | Tensor, decay: float) -> None:
        """Fold each use's pending statistics that has any into its running average: ``A``s over
        their rows, ``G``s times ``g_scale`` (``output_gram_scale`` of the block's samples)."""
        for factor, scale in ((self.embedding_A, None), (self.embedding_G, g_scale),
                              (self.head_A, None), (self.head_G, g_scale)):
            if factor.pending_rows:
                factor.fold(1.0 / factor.pending_rows if scale is None else scale, decay)

    def discard_pending(self) -> None:
        for factor in self.factors().values():
            factor.discard_pending()


class EmbeddingBlock(KroneckerBlock):
    """``nn.Embedding(V, D)``: diagonal ``A (V,)`` of token frequencies, dense ``G (D, D)``."""

    module: nn.Embedding

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        if getattr(module, "sparse", False):
            return "sparse gradients (sparse=True) take the SGD path"
        return None

    supports_weight_sharing = True  # "reduce": for a tied head's leading dims only; the embedding's own uses expand
    head: TiedHead | None = None

    def __init__(self, name: str, module: nn.Module, include_bias: bool, factor_dtype: torch.dtype) -> None:
        super().__init__(name, module, include_bias, factor_dtype)
        self.unbatched = [0, 0]  # calls with 1-D indices since the last fold, and their rows

    def mask_of(self, layer_input: Any, positions: RealPositions) -> RealPositions | None:
        """The mask over the indices ``(N, T, ...)``, or over the leading dims of the tied head's input
        ``(N, T, ..., D)`` (None: no positions, or positions ``(1, T)`` broadcast over the batch, which
        ``batch_free`` leaves to SGD, recorded whole)."""
        leading = layer_input[1].shape[:-1] if isinstance(layer_input, tuple) else layer_input.shape
        if len(leading) <= 1:
            return None
        fitted = positions.fit(leading)
        if fitted is None and not positions.broadcast_over(leading):
            self.warn_unmasked(f"its input's leading dims {tuple(leading)} do not start with the mask's "
                               f"shape {tuple(positions.mask.shape)} (samples first)")
        return fitted

    def tie(self, name: str, module: nn.Module) -> bool:
        """Take the uses of a plain ``nn.Linear(D, V)`` head sharing this weight (see the module docstring)."""
        if self.head is not None or not isinstance(module, nn.Linear) or module.weight is not self.module_weight:
            return False
        self.head = TiedHead(name, module, self.A.dtype)
        return True

    def captured_modules(self) -> list[nn.Module]:
        return [self.module] if self.head is None else [self.module, self.head.module]

    def layer_input(self, args: tuple[Any, ...], kwargs: dict[str, Any], module: nn.Module | None = None) -> Any:
        """The indices, or ``(head, x)`` for the tied head's input ``x``."""
        if module is None or module is self.module:
            return super().layer_input(args, kwargs)
        return self.head, (args[0] if args else kwargs["input"]).detach()

    def describe(self) -> str:
        text = super().describe()
        if self.head is None or self.sgd_reason is not None:
            return text
        return (f"{text}; weight tied with Linear '{self.head.name}': A, G the Kronecker product nearest "
                "to the sum of both uses' running averages (head: diagonal G, dense A)")

    def make_factors(self, dtype: torch.dtype, device: torch.device) -> dict[FactorName, Factor]:
        vocabulary, dim = self.weight.shape
        return {"A": DiagonalFactor(vocabulary, dtype, device), "G": Factor(dim, dtype, device)}

    def input_rows(self, inputs: Tensor) -> Tensor:
        """The one-hot rows ``(N·R, V)`` (zero rows at ``padding_idx``); for references, O(N·R·V)."""
        rows = F.one_hot(inputs.reshape(-1), self.weight.shape[0]).to(self.weight.dtype)
        padding = self.module.padding_idx
        if padding is not None:
            rows[:, padding] = 0
        return rows

    def statistics(self) -> tuple[DiagonalFactor, Factor]:
        """The factors the embedding's own uses add to: ``A``, ``G``, or with a tied head its use factors."""
        if self.head is None:
            return self.A, self.G  # type: ignore[return-value]
        return self.head.embedding_A, self.head.embedding_G

    def add_input_gram(self, inputs: Tensor, dtype: torch.dtype) -> None:
        tokens, positions = inputs.reshape(-1), current_mask()
        if positions is None:
            counts, rows = torch.bincount(tokens, minlength=self.weight.shape[0]).to(dtype), tokens.numel()
        else:  # the real positions only (layers.positions)
            weights = positions.weights(dtype).reshape(-1)
            counts, rows = torch.bincount(tokens, weights, minlength=self.weight.shape[0]).to(dtype), positions.count
        if self.module.padding_idx is not None:
            counts[self.module.padding_idx] = 0
        self.statistics()[0].add_counts(counts, rows)

    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        return grad_output.reshape(-1, grad_output.shape[-1])

    def add_output_gram(self, grad_output: Tensor, dtype: torch.dtype) -> None:
        self.statistics()[1].add_gram(self.output_grad_rows(grad_output).to(dtype))

    def accumulate(self, inputs: Tensor | tuple[TiedHead, Tensor], grad_output: Tensor) -> None:
        if self.sgd_reason is not None:
            return
        if isinstance(inputs, tuple):  # the tied head's call
            _, x = inputs
            with torch.autocast(x.device.type, enabled=False):
                self.head.add(x, grad_output, self.reduce, current_mask())
            self.count_samples(x.shape[0] if x.dim() > 1 else 1)
            return
        padding, positions = self.module.padding_idx, current_mask()
        if padding is not None:  # zero ĝ at padding positions (a multiply, no host sync)
            grad_output = grad_output * (inputs != padding).unsqueeze(-1).to(grad_output.dtype)
        if positions is not None:  # and at the positions the mask says are not real
            grad_output = positions.keep(grad_output)
        if inputs.dim() == 1:
            self.unbatched[0] += 1
            self.unbatched[1] += inputs.shape[0]
        super().accumulate(inputs, grad_output)

    def sample_count(self, inputs: Tensor) -> int:
        return inputs.shape[0] if inputs.dim() >= 1 else 1

    def discard_pending(self) -> None:
        super().discard_pending()
        self.unbatched = [0, 0]
        if self.head is not None:
            self.head.discard_pending()

    def fold(self, decay: float, loss_reduction: str, grad_scale: float | Tensor = 1.0) -> None:
        """As :meth:`KroneckerBlock.fold`; with a tied head, each use's statistics fold into its own
        running average, and ``A``, ``G`` become their nearest Kronecker product (see the module docstring)."""
        head = self.head
        if head is None or self.pending_samples == 0:
            super().fold(decay, loss_reduction, grad_scale)
            self.unbatched = [0, 0]
            return
        head.fold(output_gram_scale(self.pending_samples, loss_reduction, grad_scale), decay)
        self.forget_samples()
        self.unbatched = [0, 0]
        self.after_factor_reduction()

    def factors_to_reduce(self) -> list[Factor]:
        """With a tied head, the four use factors (``A``, ``G`` derive from them); else ``A``, ``G``."""
        return super().factors_to_reduce() if self.head is None else list(self.head.factors().values())

    def after_factor_reduction(self) -> None:
        """With a tied head: ``A``, ``G`` ← the Kronecker product nearest to the uses' running sum."""
        head = self.head
        if head is None:
            return
        x, y = linalg.nearest_kronecker_sum(
            head.embedding_A.running, head.embedding_G.running, head.head_G.running, head.head_A.running
        )
        for factor, value, uses in ((self.A, x, (head.embedding_A, head.head_G)),
                                    (self.G, y, (head.embedding_G, head.head_A))):
            bounds = [use.rank_bound for use in uses]
            factor.set_running(value, uses[0].initialized | uses[1].initialized,
                               None if None in bounds else sum(bounds))  # type: ignore[arg-type]

    def state_dict(self, method: Method | None = None) -> dict[str, Any]:
        state = super().state_dict(method)
        if self.head is not None:
            state["uses"] = {name: factor.state_dict(method) for name, factor in self.head.factors().items()}
        return state

    def check_state(self, state: Any, method: Method | None = None) -> None:
        super().check_state(state, method)
        if self.head is None:
            return
        uses = state.get("uses")
        if not isinstance(uses, dict):
            raise ValueError("expected 'uses', the running factors of both uses of the tied weight")
        for name, factor in self.head.factors().items():
            with within(f"use factor {name}"):
                if name not in uses:
                    raise ValueError("missing")
                factor.check_state(uses[name], method)

    def load_state_dict(self, state: dict[str, Any], method: Method | None = None) -> None:
        if self.head is not None:
            for name, factor in self.head.factors().items():
                factor.load_state_dict(state["uses"][name], method)
        super().load_state_dict(state, method)

    def joint_gradient(self, weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
        return weight_grad.T

    def split(self, direction: Tensor) -> list[tuple[nn.Parameter, Tensor]]:
        return [(self.weight, direction.T.to(self.weight.dtype).contiguous())]
