"""K-FAC block for ``nn.Linear``: inputs ``(N, *, in)``, every leading dim after N is a row (R).

Weight sharing (Eschenhagen et al. 2023), over the leading dims of one call and over the several
calls of one module within one forward (an RNN cell, one block applied to several inputs): the R
uses of the weight per sample are the positions of every call in one backward pass.

- "expand" (the default) makes every use a row, ``A = (1/(N·R)) Σ a aᵀ`` over all N·R rows and
  ``G = (1/N) Σ ĝ ĝᵀ`` over them, N counted once per backward (:meth:`KroneckerBlock.count_samples`);
- "reduce" (``reduce = True``) makes one row per sample, ``a_n = (1/R) Σ_r a_{n,r}`` (the mean of
  its uses' inputs) and ``ĝ_n = Σ_r ĝ_{n,r}`` (the sum of their output-gradients),
  ``A = (1/N) Σ a_n a_nᵀ``, ``G = (1/N) Σ ĝ_n ĝ_nᵀ``. The per-sample sums of one backward pass
  are held (``(N, in)`` and ``(N, out)``) until it is complete: the Gram matrices are formed when
  the next backward pass records (gradient accumulation: one row per sample per backward) and
  before a fold; discarding the pending statistics drops them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from kfac_optim.diagnostics import warn_user
from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.hooks import current_graph_task


class LinearBlock(KroneckerBlock):
    """``nn.Linear`` with ``a`` the input rows ``(N·R, in)`` and ``g`` the output-gradient rows."""

    supports_weight_sharing = True

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

    # -- "reduce" across the calls of one backward pass ----------------------------------------

    def use_sums(self, tensor: Tensor) -> tuple[Tensor, int]:
        """``(sums (M, features), uses)``: each sample's sum over its positions and how many there
        are (M = N); without positions every row is its own unit with one use (as :meth:`input_rows`).
        The sums are a new tensor (they are summed into in place, never the layer's own)."""
        positions = self.per_sample(tensor)
        if positions is None:
            return tensor.reshape(-1, tensor.shape[-1]).clone(), 1
        return positions.sum(1), positions.shape[1]

    def accumulate(self, inputs: Tensor, grad_output: Tensor) -> None:
        """"expand": as :meth:`KroneckerBlock.accumulate`; "reduce": add the call's per-sample sums to
        those of its backward pass (see the module docstring)."""
        if not self.reduce:
            super().accumulate(inputs, grad_output)
            return
        dtype = self.A.pending.dtype
        task = current_graph_task()
        with torch.autocast(inputs.device.type, enabled=False):
            input_sums, uses = self.use_sums(inputs.to(dtype))
            grad_sums, _ = self.use_sums(grad_output.to(dtype))
        held = self._input_sums
        if held is not None and (task == -1 or task != self._shared_task or held.shape != input_sums.shape):
            if task != -1 and task == self._shared_task and not self._warned_mismatch:
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
            self._uses += uses
        self._shared_task = task
        self.count_samples(self.sample_count(inputs))

    def add_shared_grams(self) -> None:
        """Add the held per-sample sums as one row per sample to the pending sums (no-op without)."""
        if self._input_sums is None:
            return
        self.A.add_gram(self._input_sums.div_(self._uses), append_ones=self.bias is not None)
        self.G.add_gram(self._grad_sums)
        self._drop_shared_uses()

    def _drop_shared_uses(self) -> None:
        self._input_sums: Tensor | None = None
        self._grad_sums: Tensor | None = None
        self._uses = 0
        self._shared_task: int | None = None

    def clear_pending(self) -> None:
        super().clear_pending()
        self._drop_shared_uses()

    def fold(self, decay: float, loss_reduction: str, grad_scale: float | Tensor = 1.0) -> None:
        if self.pending_samples:
            self.add_shared_grams()
        super().fold(decay, loss_reduction, grad_scale)
