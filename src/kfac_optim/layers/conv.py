"""K-FAC block for ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d``: the rows are the input patches.

Every output position of every sample is a row (R = the number of output positions), the
"expand" approximation of Grosse & Martens (2016). Patches are channel-major, matching
``W.view(out, -1)``. Any padding (ints, ``'same'``, non-zero padding modes), stride and dilation
is applied as the layer applies it. A 1-d convolution is unfolded as the 2-d one with a ``(1, k)``
kernel (the same rows, so it steps exactly as that ``Conv2d``); 3-d patches come from
``Tensor.unfold`` along each spatial dimension.

Kernel taps that read only the zero padding for every output position (a 3x3 kernel with padding
1 over a 1x1 feature map: 8 of its 9 taps) give patch columns that are zero in every row, whatever
the data: which ones depends only on the geometry (input size, kernel, stride, padding, dilation;
zero padding only). Those columns are never built: the patches are sliced tap by tap for the
valid taps only, and their Gram goes to that block of ``A`` (:class:`BoxSupport`, the box of
``A``'s indices they span), with the same values as the whole unfold's.

Grouped and depthwise convolutions (``groups = g``) get one Kronecker pair per group, stored and
decomposed as batched ``(g, n, n)`` factors: group ``j`` maps input channels
``[j·C_in/g, (j+1)·C_in/g)`` to output channels ``[j·C_out/g, (j+1)·C_out/g)``, so its ``a`` rows
are its slice of the patches and its ``g`` rows its slice of the output-gradient channels.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.factor import Support

MIN_POSITIONS_FOR_COLUMNS = 64
# Leave the zero taps' columns out only when at most this many taps are valid. One tap's block of
# ``A`` is a plain strided ``(C, C)`` view; several taps' block is strided in runs of a few entries,
# whose copies cost ~30x a dense pass per entry on CPU, more than the entries skipped save
# (measured on ResNet-18's layer4.0.conv1, 2305-wide ``A`` with 4 of 9 taps valid: fold 47 ms
# against 9 ms dense, Gram 29 ms against 14 ms).
MAX_VALID_TAPS = 1

ConvNd = nn.Conv1d | nn.Conv2d | nn.Conv3d
Taps = tuple[tuple[int, int], ...]  # kernel offsets [lo, hi) per spatial dim


@dataclass(frozen=True)
class BoxSupport:
    """A :class:`~kfac_optim.layers.factor.Support` shaped as a box: where a symmetric factor
    ``(n, n)`` can be nonzero: the rows and columns of a box of its leading ``prod(shape)``
    indices viewed as an array of ``shape`` (``box``: ``(lo, hi)`` per entry of ``shape``), and
    its trailing ``extra`` indices; zero everywhere else. E.g. a convolution's
    ``A`` viewed as ``(C_in, *kernel)`` with a bias: ``extra = 1``, and ``box`` all channels and the
    kernel offsets that read inside the input.

    A box, so that its block is a strided view (no index gather). Host-side: unions need no host
    sync. An empty ``shape`` holds no index at all.
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
        if not isinstance(other, BoxSupport):
            return self if other.size == 0 else None
        if not other.shape or other == self:
            return self
        if not self.shape:
            return other
        if (self.shape, self.extra) != (other.shape, other.extra):
            return None
        box = tuple((min(a, c), max(b, d)) for (a, b), (c, d) in zip(self.box, other.box, strict=True))
        return BoxSupport(self.shape, box, self.extra)

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


class ConvBlock(KroneckerBlock):
    """``nn.ConvNd`` (N = 1, 2, 3) with ``a`` the patches ``(N·L_out, C_in/g·prod(kernel))`` per group.

    With ``reduce`` (weight sharing over positions, Eschenhagen et al. 2023's "reduce") one row per
    sample: ``a_n`` the mean of its patches, ``g_n`` the sum of its output-gradients over positions.
    """

    module: ConvNd
    supports_weight_sharing = True
    # Leave out the patch columns of taps that only ever read zero padding (see the module docstring).
    skip_zero_taps = True

    def __init__(self, name: str, module: nn.Module, include_bias: bool, factor_dtype: torch.dtype) -> None:
        self.groups = module.groups
        super().__init__(name, module, include_bias, factor_dtype)
        self._valid_taps: dict[tuple[int, ...], Taps | None] = {}

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
        patches as ``F.unfold`` returns them beats copying them into rows first. Only the valid
        taps' columns when the others read nothing but padding (:meth:`valid_taps`) and at most
        ``MAX_VALID_TAPS`` are valid."""
        taps = self.valid_taps(tuple(inputs.shape[-self.spatial_dims :])) if self.skip_zero_taps else None
        if taps is None or math.prod(hi - lo for lo, hi in taps) > MAX_VALID_TAPS:
            patches, support = self.patches(inputs), None
        else:
            patches, support = self.tap_patches(inputs, taps), self.tap_support(taps)
        patches = patches.to(dtype)
        append_ones = self.bias is not None
        if self.reduce:
            rows = patches.mean(2)
            if self.groups > 1:
                rows = rows.view(rows.shape[0], self.groups, -1).transpose(0, 1)
            self.A.add_gram(rows, append_ones=append_ones, support=support)
        elif self.groups > 1:
            batch, columns, positions = patches.shape
            per_group = patches.view(batch, self.groups, columns // self.groups, positions)
            rows = per_group.permute(1, 0, 3, 2).reshape(self.groups, batch * positions, -1)
            self.A.add_gram(rows, append_ones=append_ones, support=support)
        elif patches.shape[2] >= MIN_POSITIONS_FOR_COLUMNS:
            self.A.add_column_gram(patches, append_ones=append_ones, support=support)
        else:
            rows = patches.transpose(1, 2).reshape(-1, patches.shape[1])
            self.A.add_gram(rows, append_ones=append_ones, support=support)

    def padding_sides(self) -> list[tuple[int, int]]:
        """Zero padding ``(before, after)`` per spatial dim, as the layer applies it."""
        conv = self.module
        if isinstance(conv.padding, str):  # 'valid' or 'same' (possibly asymmetric)
            pads = conv._reversed_padding_repeated_twice
            return [(pads[2 * i], pads[2 * i + 1]) for i in reversed(range(self.spatial_dims))]
        return [(p, p) for p in conv.padding]

    def valid_taps(self, spatial: tuple[int, ...]) -> Taps | None:
        """Per spatial dim, the range ``[lo, hi)`` of kernel offsets spanning those that read inside
        an input of spatial size ``spatial`` for some output position (offsets outside it read
        only zero padding); None when that is every offset (or none, or the padding is not zeros,
        or the input is too small for the layer, which then raises as it would). Cached per size."""
        if spatial not in self._valid_taps:
            self._valid_taps[spatial] = self._compute_valid_taps(spatial)
        return self._valid_taps[spatial]

    def _compute_valid_taps(self, spatial: tuple[int, ...]) -> Taps | None:
        conv = self.module
        if conv.padding_mode != "zeros":
            return None
        taps = []
        geometry = zip(spatial, conv.kernel_size, conv.stride, conv.dilation, self.padding_sides(), strict=True)
        for size, k, s, d, (before, after) in geometry:
            outputs = (size + before + after - d * (k - 1) - 1) // s + 1
            if outputs < 1:
                return None
            # Offset t reads input index o·s + t·d − before at output o; it reads inside for some
            # o iff the first o with o·s ≥ before − t·d exists and reads below ``size``.
            valid = []
            for t in range(k):
                first = max(0, -((t * d - before) // s))  # ceil((before − t·d) / s), at least 0
                if first < outputs and first * s + t * d - before < size:
                    valid.append(t)
            if not valid:  # no tap reads inside (the patches are all zero): the plain path
                return None
            taps.append((valid[0], valid[-1] + 1))
        if all(tap == (0, k) for tap, k in zip(taps, conv.kernel_size, strict=True)):
            return None
        return tuple(taps)

    def tap_support(self, taps: Taps) -> BoxSupport:
        """``A``'s indices of the patch columns of ``taps`` (every channel of a group, channel-major)
        and of the bias."""
        channels = self.module.in_channels // self.groups
        return BoxSupport((channels, *self.module.kernel_size), ((0, channels), *taps), int(self.bias is not None))

    def tap_patches(self, inputs: Tensor, taps: Taps) -> Tensor:
        """The patches' columns of ``taps`` (see :meth:`valid_taps`), sliced offset by offset from the
        zero-padded input: ``(N, C_in·T, L_out)`` for the ``T`` taps, channel-major and then
        row-major over the taps like :meth:`patches`."""
        conv = self.module
        dims = self.spatial_dims
        batched = inputs if inputs.dim() == dims + 2 else inputs.unsqueeze(0)
        sides = self.padding_sides()
        padded = F.pad(batched, [p for before_after in reversed(sides) for p in before_after])
        outputs = [
            (size + before + after - d * (k - 1) - 1) // s + 1
            for size, k, s, d, (before, after) in zip(
                batched.shape[2:], conv.kernel_size, conv.stride, conv.dilation, sides, strict=True
            )
        ]
        views = []
        for tap in itertools.product(*(range(lo, hi) for lo, hi in taps)):
            window = tuple(
                slice(t * d, t * d + s * (o - 1) + 1, s)
                for t, d, s, o in zip(tap, conv.dilation, conv.stride, outputs, strict=True)
            )
            views.append(padded[(..., *window)])
        stacked = torch.stack(views, dim=2)  # (N, C, T, *L_out)
        return stacked.reshape(stacked.shape[0], -1, math.prod(outputs))

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
