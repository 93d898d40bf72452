"""Mixed precision for ``KFAC``: native ``torch.amp`` loss scaling and legacy NVIDIA Apex amp.

Owns: reading a step's ``found_inf`` / ``grad_scale`` (set by ``GradScaler.step``), unscaling the
gradients, the factor by which G statistics captured under a loss scale are corrected, the Apex
glue (loss scale, O1 casts around hook math, O2 master parameters), and detecting misuse.
Must not know: factor math (blocks take plain scales), ranks, schedules.

Native AMP (docs/design.md §6): ``found_inf`` is read once per step (the only host sync added) and
an inf step is skipped; ``grad_scale`` unscales the gradients with ``GradScaler.unscale_``'s kernel
(so with K-FAC off the update is SGD + GradScaler's bit for bit) and G statistics, captured from
scaled output-gradients ``s·g``, are folded with ``s⁻²`` as a device tensor. After
``scaler.unscale_(optimizer)`` the scale is read from ``RuntimeConfig(grad_scaler=scaler)``;
without it the step's statistics are dropped with a warning. The sampled Fisher's pass is never
loss-scaled (``MixedPrecision(statistics_loss_scaled=False)``).

Apex amp (legacy, O1/O2; never imported unless the optimizer went through ``amp.initialize``,
which leaves ``optimizer._amp_stash``): the loss scale (``loss_scalers[0]``, a Python float) changes
after backward and before ``step``, so the capture hooks read it during backward; O1's casts are
disabled around hook math; under O2 blocks are re-pointed at the fp32 master parameters
(``_amp_stash.all_fp16_params[i]`` pairs with ``all_fp32_from_fp16_params[i]``); when Apex skips a
step it sets ``optimizer.most_recent_scale`` and ``KFAC`` discards that backward's pending statistics.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from kfac_optim.diagnostics import warn_user

if TYPE_CHECKING:
    from kfac_optim.layers import KroneckerBlock

logger = logging.getLogger(__name__)

ScaleFactor = float | Tensor


def check_grad_scaler(grad_scaler: Any) -> torch.amp.GradScaler | None:
    """``grad_scaler`` if it is None or a ``torch.amp.GradScaler`` (``torch.cuda.amp`` included)."""
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
    return grad_scaler


def scaler_scale(grad_scaler: torch.amp.GradScaler) -> ScaleFactor:
    """The scaler's current scale without a host sync where possible (1.0 when disabled/unused)."""
    if not grad_scaler.is_enabled():
        return 1.0
    read_async = getattr(grad_scaler, "_get_scale_async", None)
    scale = read_async() if read_async is not None else grad_scaler.get_scale()
    return 1.0 if scale is None else scale


def inverse_scale(scale: ScaleFactor) -> ScaleFactor:
    """``1/scale`` computed as ``GradScaler.unscale_`` does (in float64, rounded to float32)."""
    if isinstance(scale, Tensor):
        return scale.double().reciprocal().float()
    return 1.0 / scale


def unscale_gradients(params: Iterable[Tensor], inv_scale: Tensor) -> None:
    """Multiply every gradient by ``inv_scale`` in place, as ``GradScaler.unscale_`` does."""
    by_device_and_dtype: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
    for param in params:
        grad = param.grad
        if grad is None:
            continue
        if grad.is_sparse:
            if grad.dtype is torch.float16:
                param.grad = grad = grad.coalesce()
            grad = grad._values()
        by_device_and_dtype[(grad.device, grad.dtype)].append(grad)
    for (device, _), grads in by_device_and_dtype.items():
        scratch = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, scratch, inv_scale.to(device))


class MixedPrecision:
    """Loss-scale handling of one ``KFAC`` optimizer (native GradScaler and Apex amp)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scaler: torch.amp.GradScaler | None,
        statistics_loss_scaled: bool = True,
    ) -> None:
        """``statistics_loss_scaled``: whether captured output-gradients carry the loss scale (they do
        unless they come from the unscaled sampled-Fisher pass, see ``fisher``)."""
        self._optimizer = weakref.ref(optimizer)
        self.grad_scaler = check_grad_scaler(grad_scaler)
        self.statistics_loss_scaled = statistics_loss_scaled
        self._warned_unscaled = False
        self._bound_masters: list[Tensor] | None = None

    # -- native torch.amp ----------------------------------------------------------------------

    def skip_step(self) -> bool:
        """Whether ``GradScaler.step`` reported inf/nan gradients for this step (one host sync)."""
        found_inf: Tensor | None = getattr(self._optimizer(), "found_inf", None)
        if found_inf is None or not bool(found_inf):
            return False
        logger.info("GradScaler found inf/nan gradients: step skipped, pending statistics discarded")
        return True

    def unscale(self, params: Iterable[Tensor]) -> ScaleFactor | None:
        """Unscale ``params``' gradients if ``GradScaler.step`` asks to; return the G statistics' factor.

        The factor is ``s⁻²`` for the scale ``s`` in force during backward (a tensor under native
        AMP), 1.0 without loss scaling, under Apex (whose statistics are corrected in the hooks)
        or for unscaled statistics, and None when the statistics cannot be corrected and must be
        dropped.
        """
        optimizer = self._optimizer()
        grad_scale: Tensor | None = getattr(optimizer, "grad_scale", None)
        if grad_scale is not None:
            inv_scale = inverse_scale(grad_scale)
            unscale_gradients(params, inv_scale)
            return inv_scale * inv_scale if self.statistics_loss_scaled else 1.0
        if getattr(optimizer, "found_inf", None) is None or not self.statistics_loss_scaled:
            return 1.0
        # GradScaler.step after the user's scaler.unscale_(optimizer): gradients are unscaled.
        if self.grad_scaler is not None:
            inv_scale = inverse_scale(scaler_scale(self.grad_scaler))
            return inv_scale * inv_scale
        if not self._warned_unscaled:
            warn_user(
                "scaler.unscale_(optimizer) was called before scaler.step(optimizer), but KFAC was not "
                "given the scaler: the K-FAC statistics carry an unknown loss scale and are dropped "
                "(the factors are not updated). Every such step drops them: if every step unscales "
                "first (gradient clipping), the factors never change and layers without factors take "
                "SGD's direction for the whole run. Pass KFAC(..., runtime=RuntimeConfig(grad_scaler=scaler)).",
                RuntimeWarning,
            )
            self._warned_unscaled = True
        return None

    # -- Apex amp ------------------------------------------------------------------------------

    def under_apex(self) -> bool:
        """Whether the optimizer went through Apex's ``amp.initialize``."""
        return hasattr(self._optimizer(), "_amp_stash")

    def _apex_state(self) -> Any | None:
        """Apex's ``_amp_state`` if this optimizer went through ``amp.initialize``, else None."""
        if not self.under_apex():
            return None
        return importlib.import_module("apex.amp._amp_state")._amp_state

    def accumulate(self, block: KroneckerBlock, inputs: Tensor, grad_output: Tensor) -> None:
        """Hand one captured (input, output-gradient) pair to ``block`` (the capture hooks' callback).

        Under Apex the output-gradient, scaled by Apex's current loss scale ``s``, is upcast and
        multiplied by ``1/s`` (exact for Apex's power-of-two scales; skipped for unscaled
        statistics), with O1's casts disabled while active. Otherwise (native AMP corrects at
        fold time) the pair passes unchanged.
        """
        state = self._apex_state()
        if state is None:
            block.accumulate(inputs, grad_output)
            return
        scalers = getattr(state, "loss_scalers", None)
        scale = scalers[0].loss_scale() if scalers and self.statistics_loss_scaled else 1.0
        handle = getattr(state, "handle", None)  # O1 only
        o1_casting = handle is not None and handle.is_active()
        with importlib.import_module("apex.amp").disable_casts() if o1_casting else contextlib.nullcontext():
            if scale != 1.0:
                grad_output = grad_output.to(block.G.pending.dtype) * (1.0 / scale)
            block.accumulate(inputs, grad_output)

    def bind_master_params(self, blocks: Iterable[KroneckerBlock]) -> None:
        """Point blocks at Apex O2's fp32 master parameters (after its lazy init; idempotent).

        Apex builds ``all_fp16_params`` (the model's parameters) and ``all_fp32_from_fp16_params``
        (their masters, in ``param_groups``) in one loop, so they pair by position; shapes are
        checked. A block's ``weight``/``bias`` are then the parameters the update goes to, with
        fp32, unscaled gradients; capture stays on the modules.
        """
        stash = getattr(self._optimizer(), "_amp_stash", None)
        masters = getattr(stash, "all_fp32_from_fp16_params", None)
        if masters is None or masters is self._bound_masters:
            return
        model_params = stash.all_fp16_params
        if len(model_params) != len(masters) or any(
            p.shape != m.shape for p, m in zip(model_params, masters, strict=True)
        ):
            raise RuntimeError("Apex O2 master parameters do not pair with the model's fp16 parameters")
        master_of = dict(zip(model_params, masters, strict=True))
        for block in blocks:
            block.weight = master_of.get(block.module.weight, block.module.weight)
            if block.bias is not None:
                block.bias = master_of.get(block.module.bias, block.module.bias)
        self._bound_masters = masters
        logger.info("Apex O2: K-FAC blocks now precondition %d fp32 master parameters", len(master_of))
