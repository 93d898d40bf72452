"""Curvature blocks for normalization layers' affine parameters: one dense 2x2 block per unit.

A normalization layer computes ``y = γ ⊙ x̂ + β`` per unit (a feature of ``LayerNorm``/``RMSNorm``,
a channel of ``GroupNorm``/``BatchNorm*d``), ``x̂`` the normalized input. The per-sample gradient of
unit ``i`` is ``s_i = (Σ_r ĝ_ri x̂_ri, Σ_r ĝ_ri)`` over the sample's positions ``r``, so its exact
Fisher block is ``F_i = (1/N) Σ_n ŝ_ni ŝ_niᵀ`` (2x2; 1x1 without ``β``), as kfac-jax's and ASDL's
scale-and-shift blocks. Stored in the Kronecker form of ``layers.factor`` with one group per unit:
``A = F: (units, 2, 2)`` and ``G = 1: (units, 1, 1)``, so eigen preconditioning is exactly
``(F_i + λI)⁻¹ ∇_i`` (the damped inverse applies π-damping between A and the constant G).

``x̂`` is recomputed from the layer input with the layer's own normalization (BatchNorm in
training mode normalizes with the batch's statistics). The first input dimension is the sample
(as for ``nn.Linear``).

Not registered by default: ``KFAC`` leaves normalization parameters to SGD unless you register
these blocks (``kfac_optim.register_block(nn.LayerNorm, LayerNormBlock)``, ...).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.factor import Factor, FactorName, output_gram_scale


class NormBlock(KroneckerBlock):
    """Per-unit 2x2 Fisher blocks of ``(γ_i, β_i)``; subclasses say how to normalize and where units lie."""

    # The statistics are exact per-sample gradients, summed over a sample's positions: what
    # weight sharing approximates, so "expand" and "reduce" give the same factors.
    supports_weight_sharing = True

    def __init__(self, name: str, module: nn.Module, include_bias: bool, factor_dtype: torch.dtype) -> None:
        self.groups = module.weight.numel()
        super().__init__(name, module, include_bias, factor_dtype)

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        if getattr(module, "weight", None) is None:
            return "no affine weight"
        return None

    def make_factors(self, dtype: torch.dtype, device: torch.device) -> dict[FactorName, Factor]:
        return {
            "A": Factor(1 + (self.bias is not None), dtype, device, self.groups),
            "G": Factor(1, dtype, device, self.groups),
        }

    def normalized(self, inputs: Tensor) -> Tensor:
        """``x̂``, shaped as the input."""
        raise NotImplementedError

    def per_sample(self, values: Tensor) -> Tensor:
        """``(N, units)``: per-sample sums over positions of a tensor shaped as the input."""
        raise NotImplementedError

    def input_rows(self, inputs: Tensor) -> Tensor:
        raise TypeError("a normalization block's statistics are per-sample, not rows (see accumulate)")

    def output_grad_rows(self, grad_output: Tensor) -> Tensor:
        raise TypeError("a normalization block's statistics are per-sample, not rows (see accumulate)")

    def accumulate(self, inputs: Tensor, grad_output: Tensor) -> None:
        """Add ``Σ_n s_n s_nᵀ`` per unit to A (``s_n`` from the raw output-gradients; fold scales it)."""
        dtype = self.A.pending.dtype
        with torch.autocast(inputs.device.type, enabled=False):
            grad = grad_output.to(dtype)
            scale = self.per_sample(grad * self.normalized(inputs.to(dtype)))  # (N, units)
            parts = [scale] if self.bias is None else [scale, self.per_sample(grad)]
            samples = torch.stack(parts, dim=-1).transpose(0, 1)  # (units, N, 1 or 2)
            self.A.pending.baddbmm_(samples.mT, samples)
            self.A.pending_rows += samples.shape[1]
            self.G.pending.add_(1.0)
            self.G.pending_rows += 1
        self.count_samples(samples.shape[1])

    def fold(self, decay: float, loss_reduction: str, grad_scale: float | Tensor = 1.0) -> None:
        """``A ← (1/N) Σ ŝ ŝᵀ`` with ``ŝ = N·s`` (mean loss) or ``s`` (sum), i.e. ``scale·N`` or ``/N``;
        ``G ← 1``."""
        if self.pending_samples == 0:
            return
        self.A.fold(output_gram_scale(self.pending_samples, loss_reduction, grad_scale), decay)
        self.G.fold(1.0 / self.G.pending_rows, decay)
        self.forget_samples()

    def sample_count(self, inputs: Tensor) -> int:
        return inputs.shape[0]


class LayerNormBlock(NormBlock):
    """``nn.LayerNorm`` (elementwise affine): units are the ``normalized_shape`` entries."""

    module: nn.LayerNorm

    def normalized(self, inputs: Tensor) -> Tensor:
        return F.layer_norm(inputs, self.module.normalized_shape, None, None, self.module.eps)

    def per_sample(self, values: Tensor) -> Tensor:
        units = math.prod(self.module.normalized_shape)
        return values.reshape(values.shape[0], -1, units).sum(1)


class RMSNormBlock(LayerNormBlock):
    """``nn.RMSNorm``: as LayerNorm, ``x̂ = x / rms(x)``, no shift."""

    def normalized(self, inputs: Tensor) -> Tensor:
        return F.rms_norm(inputs, self.module.normalized_shape, None, self.module.eps)


class ChannelNormBlock(NormBlock):
    """``nn.GroupNorm`` and ``nn.BatchNorm1d/2d/3d``: units are the channels (dim 1)."""

    def normalized(self, inputs: Tensor) -> Tensor:
        """``x̂`` as the module computed it: BatchNorm normalizes with the batch's statistics in
        training mode and with its running statistics in eval mode (when it tracks them), where
        K-FAC records too (eval-mode training, docs/design.md §4 "Eval mode records")."""
        module = self.module
        if isinstance(module, nn.GroupNorm):
            return F.group_norm(inputs, module.num_groups, None, None, module.eps)
        batch_statistics = module.training or module.running_mean is None
        return F.batch_norm(inputs, None if batch_statistics else module.running_mean,
                            None if batch_statistics else module.running_var, None, None, batch_statistics, 0.0,
                            module.eps)

    def per_sample(self, values: Tensor) -> Tensor:
        return values.reshape(values.shape[0], values.shape[1], -1).sum(-1)
