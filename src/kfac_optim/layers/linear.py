"""K-FAC block for ``nn.Linear``: inputs ``(N, *, in)``, every leading dim after N is a row (R).

Weight sharing over the leading dims (Eschenhagen et al. 2023): "expand" (the default) makes every
position a row, ``A = (1/(N·R)) Σ a aᵀ`` over all N·R rows; "reduce" (``reduce = True``) makes
one row per sample, ``a_n`` the mean of its positions' inputs and ``g_n`` the sum of their
output-gradients, ``A = (1/N) Σ a_n a_nᵀ``.
"""

from __future__ import annotations

from torch import Tensor

from kfac_optim.layers.base import KroneckerBlock


class LinearBlock(KroneckerBlock):
    """``nn.Linear`` with ``a`` the input rows ``(N·R, in)`` and ``g`` the output-gradient rows."""

    reduce = False

    def per_sample(self, tensor: Tensor) -> Tensor | None:
        """``(N, R, features)``: the sample's positions, or None without positions (``(N, in)``)."""
        return tensor.reshape(tensor.shape[0], -1, tensor.shape[-1]) if tensor.dim() > 2 else None

    def input_rows(self, inputs: Tensor) -> Tensor:
        positions = self.per_sample(inputs) if self.reduce else None
        return inputs.reshape(-1, inputs.shape[-1]) if positions is None else positions.mean(1)

    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        positions = self.per_sample(grad_output) if self.reduce else None
        return grad_output.reshape(-1, grad_output.shape[-1]) if positions is None else positions.sum(1)

    def sample_count(self, inputs: Tensor) -> int:
        return inputs.shape[0] if inputs.dim() > 1 else 1
