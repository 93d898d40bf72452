"""K-FAC block for ``nn.Linear``: inputs ``(N, *, in)``, every leading dim after N is a row (R).

Weight sharing (Eschenhagen et al. 2023), over the leading dims of one call and over the several
calls of one module within one forward (an RNN cell, one block applied to several inputs): the R
uses of the weight per sample are the positions of every call in one backward pass.

- "expand" (the default) makes every use a row, ``A = (1/(N·R)) Σ a aᵀ`` over all N·R rows and
  ``G = (1/N) Σ ĝ ĝᵀ`` over them, N counted once per backward and model call (:meth:`KroneckerBlock.count_samples`);
- "reduce" (``reduce = True``) makes one row per sample, ``a_n = (1/R) Σ_r a_{n,r}`` (the mean of
  its uses' inputs) and ``ĝ_n = Σ_r ĝ_{n,r}`` (the sum of their output-gradients),
  ``A = (1/N) Σ a_n a_nᵀ``, ``G = (1/N) Σ ĝ_n ĝ_nᵀ``. The per-sample sums of one backward pass
  are held (``(N, in)`` and ``(N, out)``) until it is complete: the Gram matrices are formed when
  the next backward pass records (gradient accumulation: one row per sample per backward) and
  before a fold; discarding the pending statistics drops them.

Calls of the module hold the same samples when they come from one forward of the model, different
samples when they come from separate ones (chunks of a batch; :meth:`KroneckerBlock.count_samples`).

Padding (``layers.positions``, docs/numerics.md): under ``KFAC.mask`` a call whose input's leading
dims start with the mask's shape counts only the real positions, in both modes. A nested jagged
input (``torch.nested``, ``layout=torch.jagged``: ``(N, j, in)``) has no padding: its rows are its
values ``(Σ_n j_n, in)``, N its number of sequences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from kfac_optim.diagnostics import warn_user
from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.factor import Factor, FactorName
from kfac_optim.layers.hooks import current_mask, current_samples
from kfac_optim.layers.positions import RealPositions


class LinearBlock(KroneckerBlock):
    """``nn.Linear`` with ``a`` the input rows ``(N·R, in)`` and ``g`` the output-gradient rows."""

    supports_weight_sharing = True
    takes_nested = True
    _uses: int | Tensor

    def __init__(self, name: str, module: nn.Module, include_bias: bool, factor_dtype: torch.dtype) -> None:
        super().__init__(name, module, include_bias, factor_dtype)
        self._drop_shared_uses()
        self._warned_mismatch = False

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

    def mask_of(self, layer_input: Any, positions: RealPositions) -> RealPositions | None:
        """The mask over the input's leading dims ``(N, T, ...)``, or over tokens flattened to
        ``(N·T, in)`` ("expand"; a mixture-of-experts block's ``h.reshape(-1, D)``); None: an input
        without positions (``(N, in)``, pooled), a nested one, or positions ``(1, T, ...)`` broadcast
        over the batch (batch-free), recorded whole. An input with positions of another shape is
        recorded whole with a one-time warning."""
        if not isinstance(layer_input, Tensor) or layer_input.is_nested or layer_input.dim() < 2:
            return None
        flattened = layer_input.dim() == 2
        if flattened and (layer_input.shape[0] != positions.mask.numel() or positions.mask.dim() < 2):
            return None
        if flattened and self.reduce:
            self.warn_unmasked("its input holds flattened tokens, whose samples "
                               "CurvatureConfig(weight_sharing='reduce') cannot group")
            return None
        fitted = positions.fit(layer_input.shape[:-1])
        if fitted is None and not positions.broadcast_over(layer_input.shape[:-1]):
            self.warn_unmasked(f"its input's leading dims {tuple(layer_input.shape[:-1])} do not start with the "
                               f"mask's shape {tuple(positions.mask.shape)} (samples first)")
        return fitted

    # -- "reduce" across the calls of one backward pass ----------------------------------------

    def use_sums(self, tensor: Tensor, positions: RealPositions | None = None) -> tuple[Tensor, int | Tensor]:
        """``(sums (M, features), uses)``: each sample's sum over its (real) positions and how many
        there are (M = N; a tensor ``(N, 1)`` under a mask or for a nested input); without positions
        every row is its own unit with one use (as :meth:`input_rows`). The sums are a new tensor
        (they are summed into in place, never the layer's own)."""
        if tensor.is_nested:
            values, lengths = tensor.values(), tensor.offsets().diff()
            samples = torch.repeat_interleave(torch.arange(tensor.shape[0], device=values.device), lengths,
                                              output_size=values.shape[0])
            sums = values.new_zeros(tensor.shape[0], values.shape[-1]).index_add_(0, samples, values)
            return sums, lengths.unsqueeze(1).to(values.dtype)
        per_sample = self.per_sample(tensor)
        if per_sample is None:
            return tensor.reshape(-1, tensor.shape[-1]).clone(), 1
        if positions is None:
            return per_sample.sum(1), per_sample.shape[1]
        weights = self.per_sample(positions.mask.unsqueeze(-1).to(tensor.dtype))  # (N, R, 1) as the positions
        return self.per_sample(positions.keep(tensor)).sum(1), weights.sum(1)

    def real_rows(self, inputs: Tensor, grad_output: Tensor,
                  positions: RealPositions | None) -> tuple[Tensor, Tensor, int]:
        """``(a (R, in), g (R, out), real)``: a nested input's values, or the rows with the padded
        ones zeroed, and how many rows are real ("expand")."""
        if inputs.is_nested:
            values = inputs.values()
            return values, grad_output.values(), values.shape[0]
        assert positions is not None
        return (positions.keep(inputs.reshape(-1, inputs.shape[-1])),
                positions.keep(grad_output.reshape(-1, grad_output.shape[-1])), positions.count)

    def accumulate(self, inputs: Tensor, grad_output: Tensor) -> None:
        """"expand": as :meth:`KroneckerBlock.accumulate` (real rows only under a mask or for a nested
        input); "reduce": add the call's per-sample sums to those of its backward pass and model call
        (see the module docstring)."""
        positions = current_mask()
        if not self.reduce and positions is None and not inputs.is_nested:
            super().accumulate(inputs, grad_output)
            return
        dtype = self.A.pending.dtype
        with torch.autocast(inputs.device.type, enabled=False):
            if not self.reduce:
                a, g, real = self.real_rows(inputs.to(dtype), grad_output.to(dtype), positions)
                self.A.add_gram(a, append_ones=self.bias is not None, count=real)
                self.G.add_gram(g)
                self.count_samples(self.sample_count(inputs))
                return
            input_sums, uses = self.use_sums(inputs.to(dtype), positions)
            grad_sums, _ = self.use_sums(grad_output.to(dtype), positions)
        key = current_samples()
        held = self._input_sums
        if held is not None and (key[0] == -1 or key != self._shared_key or held.shape != input_sums.shape):
            same_backward = self._shared_key is not None and key[0] != -1 and key[0] == self._shared_key[0]
            if same_backward and held.shape != input_sums.shape and not self._warned_mismatch:
                self._warned_mismatch = True
                warn_user(
                    f"K-FAC layer '{self.name}' was called with {held.shape[0]} and {input_sums.shape[0]} samples "
                    "in one backward pass: CurvatureConfig(weight_sharing='reduce') treats those calls as "
                    "different samples"
                )
            self.add_shared_grams()
            held = None
        if held is None:
            self._input_sums, self._grad_sums, self._uses = input_sums, grad_sums, uses
        else:
            held.add_(input_sums)
            self._grad_sums.add_(grad_sums)
            self._uses = self._uses + uses
        self._shared_key = key
        self.count_samples(self.sample_count(inputs))

    def add_shared_grams(self) -> None:
        """Add the held per-sample sums as one row per sample to the pending sums (no-op without)."""
        if self._input_sums is None:
            return
        # a sample with no real position: 0
        uses = self._uses if isinstance(self._uses, int) else self._uses.clamp(min=1)
        self.A.add_gram(self._input_sums.div_(uses), append_ones=self.bias is not None)
        self.G.add_gram(self._grad_sums)
        self._drop_shared_uses()

    def _drop_shared_uses(self) -> None:
        self._input_sums: Tensor | None = None
        self._grad_sums: Tensor | None = None
        self._uses = 0
        self._shared_key: tuple[int, int] | None = None

    def discard_pending(self) -> None:
        super().discard_pending()
        self._drop_shared_uses()

    def fold(self, decay: float, loss_reduction: str, grad_scale: float | Tensor = 1.0) -> None:
        if self.pending_samples:
            self.add_shared_grams()
        super().fold(decay, loss_reduction, grad_scale)


class TransposedLinearBlock(LinearBlock):
    """A Linear whose weight is stored transposed, ``W: (in, out)``, ``y = x W + b`` (Hugging Face's
    ``transformers.pytorch_utils.Conv1D``, GPT-2's attention and MLP matrices).

    Its statistics are those of ``nn.Linear(in, out)`` holding ``Wᵀ``: ``A: (in [+1], in [+1])`` of
    the inputs, ``G: (out, out)`` of the output-gradients, so the joint gradient is ``[∇Wᵀ | ∇b]:
    (out, in [+1])`` and the weight's direction goes back transposed, ``(in, out)``.
    """

    def make_factors(self, dtype: torch.dtype, device: torch.device) -> dict[FactorName, Factor]:
        in_dim, out_dim = self.weight.shape
        return {"A": Factor(in_dim + (self.bias is not None), dtype, device), "G": Factor(out_dim, dtype, device)}

    def joint_gradient(self, weight_grad: Tensor, bias_grad: Tensor | None) -> Tensor:
        return super().joint_gradient(weight_grad.T, bias_grad)

    def weight_direction(self, matrix: Tensor) -> Tensor:
        return matrix.T.contiguous()
