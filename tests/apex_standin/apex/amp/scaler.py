"""Dynamic/static loss scaler (follows ``apex/amp/scaler.py``, fused-kernel path).

``unscale`` writes ``model_grad * (1/scale)`` into the master grad (in place when they are the
same tensor, O1), ``unscale_with_stashed`` writes ``model_grad/scale + stashed``; both flag an
overflow when an incoming model grad is not finite. ``update_scale`` reads the flag once, halves
the scale on overflow and doubles it after ``scale_window`` clean updates.
"""

from __future__ import annotations

import torch


class LossScaler:
    """One loss scale; ``loss_scale="dynamic"`` starts at ``init_scale``, else a fixed float."""

    def __init__(
        self,
        loss_scale: float | str,
        init_scale: float = 2.0**16,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float = 2.0**24,
    ) -> None:
        self.dynamic = loss_scale == "dynamic"
        self._loss_scale = init_scale if self.dynamic else float(loss_scale)
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0
        self._has_overflow = False
        self._overflow_buf = torch.zeros((), dtype=torch.bool)

    def loss_scale(self) -> float:
        """The current scale (a Python float)."""
        return self._loss_scale

    def _scale(
        self,
        model_grads: list[torch.Tensor],
        master_grads: list[torch.Tensor],
        stashed: list[torch.Tensor] | None,
    ) -> None:
        inv_scale = 1.0 / self._loss_scale
        for i, (model, master) in enumerate(zip(model_grads, master_grads)):
            self._overflow_buf |= ~torch.isfinite(model).all()
            out = model.float() * inv_scale
            if stashed is not None:
                out += stashed[i]
            master.copy_(out)

    def unscale(
        self,
        model_grads: list[torch.Tensor],
        master_grads: list[torch.Tensor],
        unused_scale: float,
        models_are_masters: bool = False,
    ) -> None:
        """``master = model / scale`` for each pair; a no-op after an overflow was recorded."""
        if self._has_overflow:
            return
        if self._loss_scale == 1.0 and models_are_masters and not self.dynamic:
            return
        self._scale(model_grads, master_grads, None)

    def unscale_with_stashed(
        self,
        model_grads: list[torch.Tensor],
        stashed_master_grads: list[torch.Tensor],
        master_grads: list[torch.Tensor],
    ) -> None:
        """``master = model / scale + stashed`` (gradient accumulation across backward passes)."""
        if self._has_overflow:
            return
        self._scale(model_grads, master_grads, stashed_master_grads)

    def clear_overflow_state(self) -> None:
        """Forget the overflow of the previous backward (called on every ``scale_loss`` exit)."""
        self._has_overflow = False
        self._overflow_buf.zero_()

    def update_scale(self) -> bool:
        """Read the overflow flag, adapt a dynamic scale, and return whether to skip the step."""
        if self.dynamic and not self._has_overflow:
            self._has_overflow = bool(self._overflow_buf.item())
        if self._has_overflow and self.dynamic:
            should_skip = True
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / 2.0)
            else:
                self._loss_scale = self._loss_scale / 2.0
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.0)
            self._unskipped = 0
        return should_skip
