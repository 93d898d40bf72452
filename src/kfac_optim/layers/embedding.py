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
embedding; docs/design.md §3): the block also captures the head. Each use of ``W`` gives gradients
``u vᵀ`` with ``u`` on the V side and ``v`` on the D side: the embedding's ``(one-hot a, ĝ)``, the
head's ``(ĝ, a)``. So the Fisher of ``W`` is approximated by the sum of two Kronecker products,
``diag(A_emb) ⊗ G_emb + diag(G_head) ⊗ A_head`` (the head's ``G: (V, V)`` kept to its diagonal,
``Σ ĝ²/N``, never a ``V x V`` matrix; ``A_head = (1/(N·R)) Σ a aᵀ``, or per sample with
``reduce``), and each fold replaces that sum by the Kronecker product nearest to it in Frobenius
norm (``linalg.nearest_kronecker_sum``): ``A (V,)`` diagonal, ``G (D, D)`` dense, as for an
untied embedding, which it equals exactly when the head records nothing. The two uses cannot be
summed per sample (their sides are swapped), so ``reduce`` applies within the head's call only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim import linalg
from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.factor import DiagonalFactor, Factor, FactorName, output_gram_scale


class TiedHead:
    """Pending statistics of a Linear head sharing an embedding's weight ``(V, D)``: ``inputs``,
    ``Σ a aᵀ: (D, D)``; ``grad_squares``, ``Σ ĝ²: (V,)`` (the diagonal of ``Σ ĝ ĝᵀ``); over ``rows`` rows."""

    def __init__(self, name: str, module: nn.Linear, dtype: torch.dtype) -> None:
        self.name = name
        self.module = module
        vocabulary, dim = module.weight.shape
        self.inputs = torch.zeros(dim, dim, dtype=dtype, device=module.weight.device)
        self.grad_squares = torch.zeros(vocabulary, dtype=dtype, device=module.weight.device)
        self.rows = 0

    def add(self, inputs: Tensor, grad_output: Tensor, reduce: bool) -> None:
        """Add one call's rows: every position (expand), or per sample the mean input and the
        summed output-gradient over its positions (``reduce``, inputs ``(N, *, D)`` with positions)."""
        a, g = inputs.to(self.inputs.dtype), grad_output.to(self.inputs.dtype)
        if reduce and a.dim() > 2:
            a = a.reshape(a.shape[0], -1, a.shape[-1]).mean(1)
            g = g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)
        a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        linalg.add_gram_(self.inputs, a)
        self.grad_squares += g.square().sum(0)
        self.rows += a.shape[0]

    def clear(self) -> None:
        if self.rows:
            self.inputs.zero_()
            self.grad_squares.zero_()
            self.rows = 0


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

    def tie(self, name: str, module: nn.Module) -> bool:
        """Take the uses of a plain ``nn.Linear(D, V)`` head sharing this weight (see the module docstring)."""
        if self.head is not None or not isinstance(module, nn.Linear) or module.weight is not self.module_weight:
            return False
        self.head = TiedHead(name, module, self.A.pending.dtype)
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
        if self.head is None:
            return text
        return (f"{text}; weight tied with Linear '{self.head.name}': A, G the Kronecker product nearest "
                "to the sum of both uses' (head: diagonal G, dense A)")

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

    def add_input_gram(self, inputs: Tensor, dtype: torch.dtype) -> None:
        tokens = inputs.reshape(-1)
        counts = torch.bincount(tokens, minlength=self.weight.shape[0]).to(dtype)
        if self.module.padding_idx is not None:
            counts[self.module.padding_idx] = 0
        self.A.add_counts(counts, tokens.numel())

    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        return grad_output.reshape(-1, grad_output.shape[-1])

    def accumulate(self, inputs: Tensor | tuple[TiedHead, Tensor], grad_output: Tensor) -> None:
        if isinstance(inputs, tuple):  # the tied head's call
            _, x = inputs
            with torch.autocast(x.device.type, enabled=False):
                self.head.add(x, grad_output, self.reduce)
            self.count_samples(x.shape[0] if x.dim() > 1 else 1)
            return
        padding = self.module.padding_idx
        if padding is not None:  # zero ĝ at padding positions (a multiply, no host sync)
            grad_output = grad_output * (inputs != padding).unsqueeze(-1).to(grad_output.dtype)
        super().accumulate(inputs, grad_output)

    def sample_count(self, inputs: Tensor) -> int:
        return inputs.shape[0] if inputs.dim() >= 1 else 1

    def clear_pending(self) -> None:
        super().clear_pending()
        if self.head is not None:
            self.head.clear()

    def fold(self, decay: float, loss_reduction: str, grad_scale: float | Tensor = 1.0) -> None:
        """As :meth:`KroneckerBlock.fold`; with a tied head, the batch's factors are the nearest
        Kronecker product to both uses' (see the module docstring)."""
        head = self.head
        if head is None or self.pending_samples == 0:
            super().fold(decay, loss_reduction, grad_scale)
            return
        g_scale = output_gram_scale(self.pending_samples, loss_reduction, grad_scale)
        a, g = self.A, self.G
        v, d = linalg.nearest_kronecker_sum(
            a.pending / max(a.pending_rows, 1), g.pending * g_scale,
            head.grad_squares * g_scale, head.inputs / max(head.rows, 1),
        )
        a.pending.copy_(v)
        g.pending.copy_(d)
        a.pending_rows += head.rows  # rows bound the factors' ranks (see Factor.rank_bound)
        g.pending_rows += head.rows
        head.clear()
        a.fold(1.0, decay)
        g.fold(1.0, decay)
        self.pending_samples = 0

    def joint_gradient(self, weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
        return weight_grad.T

    def split(self, direction: Tensor) -> list[tuple[nn.Parameter, Tensor]]:
        return [(self.weight, direction.T.to(self.weight.dtype).contiguous())]
