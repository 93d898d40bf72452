"""K-FAC block for ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d``: the rows are the input patches.

Every output position of every sample is a row (R = the number of output positions), the
"expand" approximation of Grosse & Martens (2016). Patches are channel-major, matching
``W.view(out, -1)``. Any padding (ints, ``'same'``, non-zero padding modes), stride and dilation
is applied as the layer applies it. A 1-d convolution is unfolded as the 2-d one with a ``(1, k)``
kernel (the same rows, so it steps exactly as that ``Conv2d``); 3-d patches come from
``Tensor.unfold`` along each spatial dimension.

Grouped and depthwise convolutions (``groups = g``) get one Kronecker pair per group, stored and
decomposed as batched ``(g, n, n)`` factors: group ``j`` maps input channels
``[j·C_in/g, (j+1)·C_in/g)`` to output channels ``[j·C_out/g, (j+1)·C_out/g)``, so its ``a`` rows
are its slice of the patches and its ``g`` rows its slice of the output-gradient channels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim.layers.base import KroneckerBlock

MIN_POSITIONS_FOR_COLUMNS = 64

ConvNd = nn.Conv1d | nn.Conv2d | nn.Conv3d


class ConvBlock(KroneckerBlock):
    """``nn.ConvNd`` (N = 1, 2, 3) with ``a`` the patches ``(N·L_out, C_in/g·prod(kernel))`` per group.

    With ``reduce`` (weight sharing over positions, Eschenhagen et al. 2023's "reduce") one row per
    sample: ``a_n`` the mean of its patches, ``g_n`` the sum of its output-gradients over positions.
    """

    module: ConvNd
    reduce = False

    def __init__(self, name: str, module: nn.Module, include_bias: bool, factor_dtype: torch.dtype) -> None:
        self.groups = module.groups
        super().__init__(name, module, include_bias, factor_dtype)

    @property
    def spatial_dims(self) -> int:
        return len(self.module.kernel_size)

    def input_rows(self, inputs: Tensor) -> Tensor:
        """``(N·L_out, C_in·prod(kernel))``: every group's patch columns, side by side (``(N, ·)`` with reduce)."""
        patches = self.patches(inputs)
        if self.reduce:
            return patches.mean(2)
        return patches.transpose(1, 2).reshape(-1, patches.shape[1])

    def add_input_gram(self, inputs: Tensor, dtype: torch.dtype) -> None:
        """With enough output positions per sample (measured on CPU: ≥ 64), a batched Gram of the
        patches as ``F.unfold`` returns them beats copying them into rows first."""
        patches = self.patches(inputs).to(dtype)
        append_ones = self.bias is not None
        if self.reduce:
            rows = patches.mean(2)
            if self.groups > 1:
                rows = rows.view(rows.shape[0], self.groups, -1).transpose(0, 1)
            self.A.add_gram(rows, append_ones=append_ones)
        elif self.groups > 1:
            batch, columns, positions = patches.shape
            per_group = patches.view(batch, self.groups, columns // self.groups, positions)
            rows = per_group.permute(1, 0, 3, 2).reshape(self.groups, batch * positions, -1)
            self.A.add_gram(rows, append_ones=append_ones)
        elif patches.shape[2] >= MIN_POSITIONS_FOR_COLUMNS:
            self.A.add_column_gram(patches, append_ones=append_ones)
        else:
            self.A.add_gram(patches.transpose(1, 2).reshape(-1, patches.shape[1]), append_ones=append_ones)

    def patches(self, inputs: Tensor) -> Tensor:
        """The (batched) input's patches with the layer's geometry: ``(N, C_in·prod(kernel), L_out)``."""
        conv = self.module
        dims = self.spatial_dims
        batched = inputs if inputs.dim() == dims + 2 else inputs.unsqueeze(0)
        zero_padding = conv.padding_mode == "zeros" and not isinstance(conv.padding, str)
        if not zero_padding:  # 'same' (possibly asymmetric) or a non-zero padding mode: pad as the layer does
            mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
            batched = F.pad(batched, conv._reversed_padding_repeated_twice, mode=mode)
        padding = conv.padding if zero_padding else (0,) * dims
        if dims == 1:
            return F.unfold(
                batched.unsqueeze(2), (1, *conv.kernel_size), (1, *conv.dilation), (0, *padding), (1, *conv.stride)
            )
        if dims == 2:
            return F.unfold(batched, conv.kernel_size, conv.dilation, padding, conv.stride)
        return _unfold_nd(batched, conv.kernel_size, conv.dilation, padding, conv.stride)

    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        channels = grad_output.shape[-1 - self.spatial_dims]
        if self.reduce:
            return grad_output.reshape(-1, channels, math.prod(grad_output.shape[-self.spatial_dims :])).sum(2)
        return grad_output.movedim(-1 - self.spatial_dims, -1).reshape(-1, channels)

    def add_output_gram(self, grad_output: Tensor, dtype: torch.dtype) -> None:
        rows = self.output_grad_rows(grad_output).to(dtype)
        if self.groups > 1:
            rows = rows.view(rows.shape[0], self.groups, -1).transpose(0, 1)
        self.G.add_gram(rows)

    def sample_count(self, inputs: Tensor) -> int:
        return inputs.shape[0] if inputs.dim() == self.spatial_dims + 2 else 1


def _unfold_nd(
    inputs: Tensor,
    kernel_size: tuple[int, ...],
    dilation: tuple[int, ...],
    padding: tuple[int, ...],
    stride: tuple[int, ...],
) -> Tensor:
    """``F.unfold`` for any number of spatial dims: ``(N, C, *S)`` → ``(N, C·prod(kernel), L_out)``."""
    dims = len(kernel_size)
    padded = F.pad(inputs, [p for size in reversed(padding) for p in (size, size)])
    windows = padded
    for axis, (k, d, s) in enumerate(zip(kernel_size, dilation, stride, strict=True)):
        windows = windows.unfold(2 + axis, d * (k - 1) + 1, s)[..., ::d]
    # (N, C, *S_out, *K) → (N, C, *K, *S_out) → (N, C·prod(K), prod(S_out))
    batch, channels = windows.shape[:2]
    out_shape = windows.shape[2 : 2 + dims]
    order = (0, 1, *range(2 + dims, 2 + 2 * dims), *range(2, 2 + dims))
    return windows.permute(order).reshape(batch, channels * math.prod(kernel_size), math.prod(out_shape))
