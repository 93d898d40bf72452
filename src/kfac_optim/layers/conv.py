"""K-FAC block for ``nn.Conv2d`` (groups=1): the rows are the unfolded input patches.

Every output position of every sample is a row (R = H_out·W_out), the "expand" approximation of
Grosse & Martens (2016). Patches are channel-major, matching ``W.view(out, -1)``. Any padding
(ints, ``'same'``, non-zero padding modes) is applied as the layer applies it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim.layers.base import KroneckerBlock

MIN_POSITIONS_FOR_COLUMNS = 64


class Conv2dBlock(KroneckerBlock):
    """``nn.Conv2d`` with ``a`` the patches ``(N·H_out·W_out, C_in·kh·kw)``."""

    module: nn.Conv2d

    def input_rows(self, inputs: Tensor) -> Tensor:
        patches = self.patches(inputs)
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])

    def add_input_gram(self, inputs: Tensor, dtype: torch.dtype) -> None:
        """With enough output positions per sample (measured on CPU: ≥ 64), a batched Gram of the
        patches as ``F.unfold`` returns them beats copying them into rows first."""
        patches = self.patches(inputs).to(dtype)
        if patches.shape[2] >= MIN_POSITIONS_FOR_COLUMNS:
            self.A.add_column_gram(patches, append_ones=self.bias is not None)
        else:
            self.A.add_gram(patches.transpose(1, 2).reshape(-1, patches.shape[1]), append_ones=self.bias is not None)

    def patches(self, inputs: Tensor) -> Tensor:
        """``F.unfold`` of the (batched) input with the layer's geometry: ``(N, C_in·kh·kw, H_out·W_out)``."""
        conv = self.module
        batched = inputs if inputs.dim() == 4 else inputs.unsqueeze(0)
        if conv.padding_mode == "zeros" and not isinstance(conv.padding, str):
            patches = F.unfold(batched, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
        else:  # 'same' (possibly asymmetric) or a non-zero padding mode: pad as the layer does
            mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
            padded = F.pad(batched, conv._reversed_padding_repeated_twice, mode=mode)
            patches = F.unfold(padded, conv.kernel_size, conv.dilation, 0, conv.stride)
        return patches

    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        channels = grad_output.shape[-3]
        return grad_output.movedim(-3, -1).reshape(-1, channels)

    def sample_count(self, inputs: Tensor) -> int:
        return inputs.shape[0] if inputs.dim() == 4 else 1
