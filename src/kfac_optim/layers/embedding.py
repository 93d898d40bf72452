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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim.layers.base import DiagonalFactor, Factor, FactorName, KroneckerBlock


class EmbeddingBlock(KroneckerBlock):
    """``nn.Embedding(V, D)``: diagonal ``A (V,)`` of token frequencies, dense ``G (D, D)``."""

    module: nn.Embedding

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        if getattr(module, "sparse", False):
            return "sparse gradients (sparse=True) take the SGD path"
        return None

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

    def accumulate(self, inputs: Tensor, grad_output: Tensor) -> None:
        padding = self.module.padding_idx
        if padding is not None:  # zero ĝ at padding positions (a multiply, no host sync)
            grad_output = grad_output * (inputs != padding).unsqueeze(-1).to(grad_output.dtype)
        super().accumulate(inputs, grad_output)

    def sample_count(self, inputs: Tensor) -> int:
        return inputs.shape[0] if inputs.dim() >= 1 else 1

    def joint_gradient(self, weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
        return weight_grad.T

    def split(self, direction: Tensor) -> list[tuple[nn.Parameter, Tensor]]:
        return [(self.weight, direction.T.to(self.weight.dtype).contiguous())]
