"""Which positions of a forward are real: the mask a user passes with ``KFAC.mask`` (padding).

Owns: :class:`RealPositions` (a bool mask over the leading dims of a sequence model's activations
and how many of its entries are True), its validation, and fitting it to one layer's input.
Must not know: blocks, factors, the capture (blocks apply a fitted mask to their rows, the capture
hands it to them with each pair: ``layers.hooks.recording_pair``).

Convention (docs/numerics.md, "Padding"): a padded position is not a row. ``A`` averages over
the real rows only (``A = (1/R_real) Σ_real a aᵀ``), ``G`` sums over them (``ĝ`` is zero at a
padded position under ``ignore_index`` anyway), N stays the number of sequences, and with
``weight_sharing="reduce"`` a sample's row is the mean of its real positions' inputs and the sum
of their output-gradients. So a batch padded to any length gives the factors of the same batch
unpadded (e.g. as a nested jagged tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RealPositions:
    """``mask``: bool, True at real positions, shaped as the leading dims of the layer inputs it
    applies to (``(N, T)`` for batch-first sequences); ``count``: how many are True (a host int)."""

    mask: Tensor
    count: int

    @classmethod
    def of(cls, mask: Tensor) -> RealPositions:
        """Validate a user's ``mask`` (bool or 0/1 integers, True/1 = real, at least 2 dims: samples
        first) and count its real positions (one host sync for a mask on an accelerator)."""
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a torch.Tensor of bools (True at real positions), got {type(mask).__name__}")
        if mask.dtype.is_floating_point or mask.dtype.is_complex:
            raise TypeError(f"mask must hold bools or 0/1 integers (True at real positions), got dtype {mask.dtype}")
        if mask.dim() < 2:
            raise ValueError(f"mask must have the samples first and then the positions, e.g. (N, T); got shape "
                             f"{tuple(mask.shape)}")
        mask = mask.detach().bool()
        return cls(mask, int(mask.sum()))

    def fit(self, leading: torch.Size | tuple[int, ...]) -> RealPositions | None:
        """This mask over an input whose leading dims (every dim but the features) are ``leading``:
        they start with the mask's shape, and any further dims (e.g. heads) are broadcast, or they
        start with its flattened shape (tokens flattened to ``(N·T, ...)``); None otherwise."""
        k = self.mask.dim()
        if len(leading) >= 1 and leading[0] == self.mask.numel() and k > 1:
            return RealPositions(self.mask.reshape(-1), self.count).fit(leading)
        if len(leading) < k or tuple(leading[:k]) != tuple(self.mask.shape):
            return None
        extra = tuple(leading[k:])
        mask = self.mask.reshape(*self.mask.shape, *(1 for _ in extra)).expand(*leading)
        return RealPositions(mask, self.count * math.prod(extra))

    def broadcast_over(self, leading: torch.Size | tuple[int, ...]) -> bool:
        """Whether leading dims ``leading`` are one row of the mask's positions broadcast over its
        batch (``(1, T)``: a position table, batch-free: ``batch_free`` leaves it to SGD)."""
        k = self.mask.dim()
        return (len(leading) >= k and leading[0] == 1 != self.mask.shape[0]
                and tuple(leading[1:k]) == tuple(self.mask.shape[1:]))

    def keep(self, tensor: Tensor) -> Tensor:
        """``tensor`` with its padded entries zeroed (``masked_fill``: a pad holding a non-finite value,
        e.g. a fully masked query of a left-padded row, does not leak as ``nan·0`` would); its
        leading dims are the mask's shape, or its rows ``(R, ...)`` the mask's entries in order."""
        mask = self.mask if tensor.shape[: self.mask.dim()] == self.mask.shape else self.mask.reshape(-1)
        return tensor.masked_fill(~mask.reshape(*mask.shape, *(1 for _ in range(tensor.dim() - mask.dim()))), 0)

    def weights(self, dtype: torch.dtype) -> Tensor:
        """The mask as one 0/1 weight per row ``(R, 1)`` in ``dtype``, rows in the input's order."""
        return self.mask.reshape(-1, 1).to(dtype)
