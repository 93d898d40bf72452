"""Which output positions of a convolution become rows of its factors, and with what weight.

Owns: :class:`ConvStatistics`, the statistics kinds of a convolution block (:class:`Expand`,
:class:`Reduce`, :class:`SampledPositions` and the rule :class:`ReduceAbove`), the patch
columns and output-gradient columns each hands the block, the mean patch computed without
unfolding, the fixed position subsets of :class:`SampledPositions`.
Must not know: the factors' storage, groups (the block splits the columns per group), which
kernel taps read only zero padding (the block says which taps to build), the optimizer.

Formulas and costs: docs/numerics.md, "Convolution statistics". For N samples of a layer with L
output positions per sample, patches ``a_{n,l}`` (``C_in·prod(kernel)`` wide, channel-major like
``W.view(out, -1)``; with a bias a trailing 1) and output-gradients ``ĝ_{n,l}`` (``C_out``):

- :class:`Expand`: every position a row, ``A = 1/(N·L) Σ a aᵀ``, ``G = 1/N Σ ĝ ĝᵀ``;
- :class:`Reduce` (K-FAC-reduce): one row per sample, the mean patch ``ā_n`` (bias entry 1) and
  the summed output-gradient ``ĝ_n``; the mean patch is summed axis by axis from the padded input;
- :class:`SampledPositions` (``count``, ``seed``): a fixed subset S of ``m = min(count, L)``
  positions, drawn once per output shape from a seeded generator, ``G`` scaled by ``L/m``;
- :class:`ReduceAbove` (``positions``): :class:`Expand` when ``L ≤ positions``, :class:`Reduce` above.

Each kind hands the block columns ``(N, C_in·T, L')`` (the patches of the T taps the block asks
for, at L' positions per sample: L, 1 or m) and ``(N, C_out, L')``; the block turns them into rows.
"""

from __future__ import annotations

import functools
import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

Taps = tuple[tuple[int, int], ...]  # kernel offsets [lo, hi) per spatial dim


@dataclass(frozen=True)
class ConvGeometry:
    """One call's geometry: the layer's ``kernel``, ``dilation``, ``stride``, the ``outputs``
    (output positions per spatial dim) and ``padding``: the zero padding per spatial dim (both
    sides) still to apply to the input handed over (``()``: it is padded already)."""

    kernel: tuple[int, ...]
    dilation: tuple[int, ...]
    stride: tuple[int, ...]
    outputs: tuple[int, ...]
    padding: tuple[int, ...] = ()

    def padded(self, inputs: Tensor) -> Tensor:
        """``inputs (N, C, *S)`` with :attr:`padding` applied."""
        if not any(self.padding):
            return inputs
        return F.pad(inputs, [p for size in reversed(self.padding) for p in (size, size)])

    @property
    def positions(self) -> int:
        """L, the output positions per sample."""
        return math.prod(self.outputs)

    def all_taps(self) -> Taps:
        return tuple((0, k) for k in self.kernel)


class ConvStatistics(ABC):
    """How a convolution block's captured (input, output-gradient) pair becomes factor rows.

    A block asks :meth:`resolve` with the call's output positions per sample L (a rule picks a
    kind; a kind returns itself), then that kind's :meth:`input_columns` and
    :meth:`output_columns`, whose rows (``columns[n, :, l]``) go into ``A`` and ``G`` as they are.
    """

    def resolve(self, positions: int) -> ConvStatistics:
        """The kind used for a call with ``positions`` output positions per sample."""
        return self

    @abstractmethod
    def input_columns(self, inputs: Tensor, geometry: ConvGeometry, taps: Taps | None) -> Tensor:
        """``(N, C·T, L')`` from the input ``(N, C, *S)``, padded as the layer pads it but for
        ``geometry.padding``: the patch columns of ``taps`` (None: every tap), channel-major, then
        row-major over the taps."""

    @abstractmethod
    def output_columns(self, grad_output: Tensor) -> Tensor:
        """``(N, C_out, L')`` from the output-gradient ``(N, C_out, *L_shape)``."""

    @abstractmethod
    def rows_per_sample(self, positions: int) -> int:
        """L', the rows per sample of a call with ``positions`` output positions per sample."""


@dataclass(frozen=True)
class Expand(ConvStatistics):
    """Every output position of every sample is a row (the module docstring's "expand")."""

    def input_columns(self, inputs: Tensor, geometry: ConvGeometry, taps: Taps | None) -> Tensor:
        return unfold_columns(inputs, geometry) if taps is None else tap_columns(inputs, geometry, taps)

    def output_columns(self, grad_output: Tensor) -> Tensor:
        return grad_output.reshape(*grad_output.shape[:2], -1)

    def rows_per_sample(self, positions: int) -> int:
        return positions


@dataclass(frozen=True)
class Reduce(ConvStatistics):
    """One row per sample: its mean patch and its summed output-gradient (the module docstring's "reduce")."""

    def input_columns(self, inputs: Tensor, geometry: ConvGeometry, taps: Taps | None) -> Tensor:
        if taps is not None:
            return tap_columns(inputs, geometry, taps).mean(2, keepdim=True)
        return mean_patch(inputs, geometry)

    def output_columns(self, grad_output: Tensor) -> Tensor:
        return grad_output.reshape(*grad_output.shape[:2], -1).sum(2, keepdim=True)

    def rows_per_sample(self, positions: int) -> int:
        return 1


@dataclass(frozen=True)
class SampledPositions(ConvStatistics):
    """A fixed subset of ``count`` output positions per sample, drawn once per output shape from
    ``seed``; ``G`` scaled by ``L/count`` (the module docstring). ``count`` >= 1, ``seed`` an int."""

    count: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"SampledPositions.count must be an int >= 1, got {self.count!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"SampledPositions.seed must be an int, got {self.seed!r}")

    def resolve(self, positions: int) -> ConvStatistics:
        return Expand() if positions <= self.count else self

    def input_columns(self, inputs: Tensor, geometry: ConvGeometry, taps: Taps | None) -> Tensor:
        chosen = sampled_positions(geometry.positions, self.count, self.seed, inputs.device)
        return gathered_columns(inputs, geometry, taps or geometry.all_taps(), chosen)

    def output_columns(self, grad_output: Tensor) -> Tensor:
        flat = grad_output.reshape(*grad_output.shape[:2], -1)
        positions = flat.shape[2]
        chosen = sampled_positions(positions, self.count, self.seed, flat.device)
        return flat.index_select(2, chosen) * math.sqrt(positions / self.count)

    def rows_per_sample(self, positions: int) -> int:
        return min(positions, self.count)


@dataclass(frozen=True)
class ReduceAbove(ConvStatistics):
    """:class:`Expand` for a call with at most ``positions`` output positions per sample,
    :class:`Reduce` above (``positions`` an int >= 1)."""

    positions: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.positions, bool) or not isinstance(self.positions, int) or self.positions < 1:
            raise ValueError(f"ReduceAbove.positions must be an int >= 1, got {self.positions!r}")

    def resolve(self, positions: int) -> ConvStatistics:
        return Reduce() if positions > self.positions else Expand()

    def input_columns(self, inputs: Tensor, geometry: ConvGeometry, taps: Taps | None) -> Tensor:
        return self.resolve(geometry.positions).input_columns(inputs, geometry, taps)

    def output_columns(self, grad_output: Tensor) -> Tensor:
        return self.resolve(math.prod(grad_output.shape[2:])).output_columns(grad_output)

    def rows_per_sample(self, positions: int) -> int:
        return self.resolve(positions).rows_per_sample(positions)


def check_conv_statistics(statistics: object, name: str = "conv_positions") -> None:
    """Raise ``TypeError`` naming ``name`` unless ``statistics`` is a :class:`ConvStatistics` or None."""
    if statistics is not None and not isinstance(statistics, ConvStatistics):
        raise TypeError(
            f"{name} must be a kfac_optim.layers.ConvStatistics (Expand(), Reduce(), SampledPositions(...), "
            f"ReduceAbove(...)) or None, got {statistics!r}"
        )


@functools.lru_cache(maxsize=256)
def sampled_positions(positions: int, count: int, seed: int, device: torch.device) -> Tensor:
    """The sorted ``min(count, positions)`` flat output positions of :class:`SampledPositions`:
    the first of a permutation drawn from a CPU generator seeded with ``seed`` (the same on every
    device and run), on ``device``."""
    if count >= positions:
        return torch.arange(positions, device=device)
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(positions, generator=generator)[:count].sort().values
    return chosen.to(device)


def unfold_columns(inputs: Tensor, geometry: ConvGeometry) -> Tensor:
    """``(N, C·K, L)``: every patch of ``inputs (N, C, *S)`` (``F.unfold``, which applies
    ``geometry.padding`` itself; a 1-d input as the 2-d one with a ``(1, k)`` kernel, 3-d from
    ``Tensor.unfold`` along each spatial dimension)."""
    kernel, dilation, stride = geometry.kernel, geometry.dilation, geometry.stride
    dims = len(kernel)
    padding = geometry.padding or (0,) * dims
    if dims == 1:
        return F.unfold(inputs.unsqueeze(2), (1, *kernel), (1, *dilation), (0, *padding), (1, *stride))
    if dims == 2:
        return F.unfold(inputs, kernel, dilation, padding, stride)
    windows = geometry.padded(inputs)
    for axis, (k, d, s) in enumerate(zip(kernel, dilation, stride, strict=True)):
        windows = windows.unfold(2 + axis, d * (k - 1) + 1, s)[..., ::d]
    # (N, C, *S_out, *K) → (N, C, *K, *S_out) → (N, C·prod(K), prod(S_out))
    batch, channels = windows.shape[:2]
    order = (0, 1, *range(2 + dims, 2 + 2 * dims), *range(2, 2 + dims))
    return windows.permute(order).reshape(batch, channels * math.prod(kernel), geometry.positions)


def tap_columns(inputs: Tensor, geometry: ConvGeometry, taps: Taps) -> Tensor:
    """``(N, C·T, L)``: the patch columns of ``taps`` at every output position, sliced tap by tap
    from ``inputs (N, C, *S)`` padded (strided views, then one stack)."""
    padded = geometry.padded(inputs)
    views = []
    for tap in itertools.product(*(range(lo, hi) for lo, hi in taps)):
        window = tuple(
            slice(t * d, t * d + s * (o - 1) + 1, s)
            for t, d, s, o in zip(tap, geometry.dilation, geometry.stride, geometry.outputs, strict=True)
        )
        views.append(padded[(..., *window)])
    stacked = torch.stack(views, dim=2)  # (N, C, T, *L_shape)
    return stacked.reshape(stacked.shape[0], -1, geometry.positions)


def gathered_columns(inputs: Tensor, geometry: ConvGeometry, taps: Taps, positions: Tensor) -> Tensor:
    """``(N, C·T, m)``: the patch columns of ``taps`` at the m flat output ``positions`` only, one
    gather from ``inputs (N, C, *S)`` padded (``N·C·T·m`` entries read, whatever L is)."""
    padded = geometry.padded(inputs)
    dims = len(geometry.outputs)
    coordinates, remaining = [], positions
    for size in reversed(geometry.outputs):  # unravel the flat positions, last axis fastest
        coordinates.append(remaining % size)
        remaining = remaining // size
    coordinates.reverse()
    index = torch.zeros((), dtype=torch.long, device=positions.device)
    step = 1
    for axis in reversed(range(dims)):  # flat index into padded[n, c]: (T_1, ..., T_D, m)
        lo, hi = taps[axis]
        offsets = torch.arange(lo, hi, device=positions.device) * geometry.dilation[axis]
        read = offsets.view(-1, *([1] * (dims - axis))) + coordinates[axis] * geometry.stride[axis]
        index = index + read * step
        step *= padded.shape[2 + axis]
    flat = padded.reshape(*padded.shape[:2], -1)
    gathered = flat.index_select(2, index.reshape(-1))  # (N, C, T·m)
    return gathered.reshape(flat.shape[0], -1, positions.shape[0])


def mean_patch(inputs: Tensor, geometry: ConvGeometry) -> Tensor:
    """``(N, C·K, 1)``: each sample's mean patch over its L output positions, from ``inputs
    (N, C, *S)`` padded, one spatial axis at a time: along axis j, tap t's sum over the outputs is the
    sum of the strided window starting at ``t·dilation`` (``Tensor.unfold`` views, no copy), so
    the first axis reads ``N·C·k·L_1·S_rest`` entries and no ``(N, C·K, L)`` unfold is made."""
    summed = geometry.padded(inputs)
    for axis, (k, d, s, o) in enumerate(
        zip(geometry.kernel, geometry.dilation, geometry.stride, geometry.outputs, strict=True), start=2
    ):
        windows = summed.unfold(axis, s * (o - 1) + 1, d).narrow(axis, 0, k)  # (..., k, ..., span)
        summed = windows[..., ::s].sum(-1)
    return summed.reshape(summed.shape[0], -1, 1) / geometry.positions
