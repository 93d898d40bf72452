"""K-FAC block for ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d``: the rows are the input patches.

By default every output position of every sample is a row (R = the number of output positions),
the "expand" approximation of Grosse & Martens (2016); which positions become rows, and how, is
the block's :class:`~kfac_optim.layers.conv_statistics.ConvStatistics` (``Reduce``: one row per
sample; ``SampledPositions``; the rule ``ReduceAbove``), which builds the columns from the input
padded here. Patches are channel-major, matching ``W.view(out, -1)``. Any padding (ints,
``'same'``, non-zero padding modes), stride and dilation is applied as the layer applies it. A 1-d
convolution is unfolded as the 2-d one with a ``(1, k)`` kernel (the same rows, so it steps
exactly as that ``Conv2d``); 3-d patches come from ``Tensor.unfold`` along each spatial dimension.

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

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.conv_statistics import ConvGeometry, ConvStatistics, Expand, Reduce, Taps
from kfac_optim.layers.factor import Support

MIN_POSITIONS_FOR_COLUMNS = 64
# Leave the zero taps' columns out only when at most this many taps are valid. One tap's block of
# ``A`` is a plain strided ``(C, C)`` view; several taps' block is strided in runs of a few entries,
# whose copies cost ~30x a dense pass per entry on CPU, more than the entries skipped save
# (measured on ResNet-18's layer4.0.conv1, 2305-wide ``A`` with 4 of 9 taps valid: fold 47 ms
# against 9 ms dense, Gram 29 ms against 14 ms).
MAX_VALID_TAPS = 1

ConvNd = nn.Conv1d | nn.Conv2d | nn.Conv3d


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

    Which positions become rows is :attr:`statistics` (``layers.conv_statistics``: every position,
    "expand", by default; ``weight_sharing="reduce"`` or ``CurvatureConfig.conv_positions`` set it).
    """

    module: ConvNd
    supports_weight_sharing = True
    default_statistics: ClassVar[ConvStatistics] = Expand()
    """:attr:`statistics` unless ``weight_sharing="reduce"`` (:class:`Reduce`) or
    ``CurvatureConfig.conv_positions`` says otherwise."""
    # Leave out the patch columns of taps that only ever read zero padding (see the module docstring).
    skip_zero_taps = True

    def __init__(self, name: str, module: nn.Module, include_bias: bool, factor_dtype: torch.dtype) -> None:
        self.groups = module.groups
        super().__init__(name, module, include_bias, factor_dtype)
        self._valid_taps: dict[tuple[int, ...], Taps | None] = {}
        self._forward_rows = 0
        self.statistics: ConvStatistics = self.default_statistics
        """Which output positions become rows of ``A`` and ``G`` (:class:`ConvStatistics`)."""

    @property
    def reduce(self) -> bool:  # type: ignore[override]
        """Whether :attr:`statistics` is :class:`Reduce` (``weight_sharing="reduce"``); setting it
        sets :attr:`statistics` to :class:`Reduce`, or (False) to :attr:`default_statistics`."""
        return isinstance(self.statistics, Reduce)

    @reduce.setter
    def reduce(self, value: bool) -> None:
        self.statistics = Reduce() if value else self.default_statistics

    @property
    def spatial_dims(self) -> int:
        return len(self.module.kernel_size)

    def describe(self) -> str:
        """As :meth:`KroneckerBlock.describe`, with :attr:`statistics` unless it is :class:`Expand`."""
        text = super().describe()
        return text if isinstance(self.statistics, Expand) else f"{text}; statistics {self.statistics!r}"

    def batched(self, tensor: Tensor) -> Tensor:
        """``tensor`` with its batch dim (an unbatched ``(C, *S)`` becomes ``(1, C, *S)``)."""
        return tensor if tensor.dim() == self.spatial_dims + 2 else tensor.unsqueeze(0)

    def prepared_input(self, inputs: Tensor) -> tuple[Tensor, ConvGeometry]:
        """The (batched) input and the call's geometry: plain zero padding (ints) is left to the
        statistics (``geometry.padding``: ``F.unfold`` applies it without a copy); any other
        (``'same'``, possibly asymmetric, or a non-zero padding mode) is applied here as the layer does."""
        batched = self.batched(inputs)
        conv = self.module
        if conv.padding_mode == "zeros" and not isinstance(conv.padding, str):
            padding = tuple(conv.padding)
            spatial = tuple(size + 2 * p for size, p in zip(batched.shape[2:], padding, strict=True))
            return batched, self.geometry(spatial, padding)
        if conv.padding_mode == "zeros":
            padded = F.pad(batched, [p for before_after in reversed(self.padding_sides()) for p in before_after])
        else:
            padded = F.pad(batched, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
        return padded, self.geometry(tuple(padded.shape[2:]))

    def geometry(self, padded: tuple[int, ...], padding: tuple[int, ...] = ()) -> ConvGeometry:
        """The layer's geometry on an input of padded spatial size ``padded`` (``padding``: the zero
        padding still to apply, see :class:`ConvGeometry`)."""
        conv = self.module
        outputs = tuple(
            (size - d * (k - 1) - 1) // s + 1
            for size, k, s, d in zip(padded, conv.kernel_size, conv.stride, conv.dilation, strict=True)
        )
        return ConvGeometry(tuple(conv.kernel_size), tuple(conv.dilation), tuple(conv.stride), outputs, padding)

    def forward_rows(self) -> int:
        """The patches the layer's forward multiplied in the captures since the last fold (N·L per
        call), whatever :attr:`statistics` made rows of."""
        return self._forward_rows

    def discard_pending(self) -> None:
        super().discard_pending()
        self._forward_rows = 0

    def fold(self, decay: float, loss_reduction: str, grad_scale: float | Tensor = 1.0) -> None:
        super().fold(decay, loss_reduction, grad_scale)
        self._forward_rows = 0

    def input_columns(self, inputs: Tensor) -> tuple[Tensor, Support | None]:
        """``(columns (N, C_in·T, L'), support)``: :attr:`statistics`' patch columns (see
        ``layers.conv_statistics``) and, when only the valid taps' columns are built (the others
        read nothing but padding, :meth:`valid_taps`, and at most ``MAX_VALID_TAPS`` are valid),
        the support of ``A`` they span (else None: every column)."""
        prepared, geometry = self.prepared_input(inputs)
        taps = self.valid_taps(tuple(inputs.shape[-self.spatial_dims :])) if self.skip_zero_taps else None
        if taps is not None and math.prod(hi - lo for lo, hi in taps) > MAX_VALID_TAPS:
            taps = None
        columns = self.statistics.resolve(geometry.positions).input_columns(prepared, geometry, taps)
        self._forward_rows += prepared.shape[0] * geometry.positions
        return columns, None if taps is None else self.tap_support(taps)

    def input_rows(self, inputs: Tensor) -> Tensor:
        """``(N·L', C_in·prod(kernel))``: every group's patch columns, side by side (L' = L_out for
        "expand", 1 for "reduce": see :attr:`statistics`)."""
        prepared, geometry = self.prepared_input(inputs)
        columns = self.statistics.resolve(geometry.positions).input_columns(prepared, geometry, None)
        return columns.transpose(1, 2).reshape(-1, columns.shape[1])

    def add_input_gram(self, inputs: Tensor, dtype: torch.dtype) -> None:
        """With enough rows per sample (measured on CPU: ≥ 64), a batched Gram of the columns as
        they are beats copying them into rows first."""
        columns, support = self.input_columns(inputs)
        columns = columns.to(dtype)
        append_ones = self.bias is not None
        batch, width, positions = columns.shape
        if self.groups > 1:
            per_group = columns.view(batch, self.groups, width // self.groups, positions)
            rows = per_group.permute(1, 0, 3, 2).reshape(self.groups, batch * positions, -1)
            self.A.add_gram(rows, append_ones=append_ones, support=support)
        elif positions >= MIN_POSITIONS_FOR_COLUMNS:
            self.A.add_column_gram(columns, append_ones=append_ones, support=support)
        else:
            rows = columns.transpose(1, 2).reshape(-1, width)
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

    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        """``(N·L', C_out)``: :attr:`statistics`' output-gradient columns as rows."""
        batched = self.batched(grad_output)
        columns = self.statistics.resolve(math.prod(batched.shape[2:])).output_columns(batched)
        return columns.transpose(1, 2).reshape(-1, columns.shape[1])

    def add_output_gram(self, grad_output: Tensor, dtype: torch.dtype) -> None:
        rows = self.output_grad_rows(grad_output).to(dtype)
        if self.groups > 1:
            rows = rows.view(rows.shape[0], self.groups, -1).transpose(0, 1)
        self.G.add_gram(rows)

    def sample_count(self, inputs: Tensor) -> int:
        return inputs.shape[0] if inputs.dim() == self.spatial_dims + 2 else 1

