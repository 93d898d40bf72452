"""K-FAC block for ``nn.Linear``: inputs ``(N, *, in)``, every leading dim after N is a row (R)."""

from __future__ import annotations

from torch import Tensor

from kfac_optim.layers.base import KroneckerBlock


class LinearBlock(KroneckerBlock):
    """``nn.Linear`` with ``a`` the input rows ``(N·R, in)`` and ``g`` the output-gradient rows."""

    def input_rows(self, inputs: Tensor) -> Tensor:
        return inputs.reshape(-1, inputs.shape[-1])

    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        return grad_output.reshape(-1, grad_output.shape[-1])

    def sample_count(self, inputs: Tensor) -> int:
        return inputs.shape[0] if inputs.dim() > 1 else 1
