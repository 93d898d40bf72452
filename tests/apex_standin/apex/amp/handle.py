"""``scale_loss``, ``disable_casts`` and O1's cast handle (follows ``apex/amp/handle.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._amp_state import _amp_state, maybe_print
from .scaler import LossScaler


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer],
    loss_id: int = 0,
    model: torch.nn.Module | None = None,
    delay_unscale: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * scale``; on exit unscale the grads and arm the overflow skip.

    On entry each optimizer stashes and clears its grads (``_prepare_amp_backward``); on exit
    (unless ``delay_unscale``) the new grads are unscaled into the fp32 master grads (O2) or in
    place (O1), the scaler updates, and after an overflow ``optimizer.step`` becomes a one-shot
    ``skip_step``.
    """
    if not hasattr(_amp_state, "opt_properties"):
        raise RuntimeError(
            "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized."
        )
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    loss_scaler = _amp_state.loss_scalers[loss_id]
    loss_scale = loss_scaler.loss_scale()
    if (
        not _amp_state.opt_properties.master_weights
        and not loss_scaler.dynamic
        and loss_scale == 1.0
    ):
        yield loss.float()
        if _amp_state.opt_properties.patch_torch_functions:
            _amp_state.handle._clear_cache()
        return
    if not delay_unscale:
        for optimizer in optimizers:
            if not optimizer._amp_stash.params_have_scaled_gradients:
                optimizer._prepare_amp_backward()

    yield loss.float() * loss_scale

    if delay_unscale:
        for optimizer in optimizers:
            optimizer._amp_stash.params_have_scaled_gradients = True
    else:
        loss_scaler.clear_overflow_state()
        for optimizer in optimizers:
            optimizer._post_amp_backward(loss_scaler)
            optimizer._amp_stash.params_have_scaled_gradients = False
        if loss_scaler.update_scale():
            for optimizer in optimizers:
                if not optimizer._amp_stash.already_patched:
                    optimizer.step = _skip_step(optimizer, loss_scaler, loss_id)
                    optimizer._amp_stash.already_patched = True
    if _amp_state.opt_properties.patch_torch_functions:
        _amp_state.handle._clear_cache()


def _skip_step(
    opt: torch.optim.Optimizer, loss_scaler: LossScaler, loss_id: int
) -> Callable[..., None]:
    """Build the one-shot replacement of ``opt.step`` installed after an overflow."""
    opt_step = opt.step

    def skip_step(closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        maybe_print(
            f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
            f"{loss_scaler.loss_scale()}"
        )
        if hasattr(opt._amp_stash, "all_fp32_from_fp16_params"):
            for param in opt._amp_stash.all_fp32_from_fp16_params:
                param.grad = None
        if hasattr(opt, "most_recent_scale"):
            opt.most_recent_scale = 1.0
            opt.scale_set_by_backward = False
        opt.step = opt_step
        opt._amp_stash.already_patched = False

    return skip_step


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Turn O1's casts off for the block (not re-entrant: the exit always turns them back on).

    Like Apex, this needs ``_amp_state.handle``, which only an O1 ``amp.initialize`` creates.
    """
    _amp_state.handle._is_active = False
    yield
    _amp_state.handle._is_active = True


class AmpHandle:
    """Holds O1's on/off switch and the originals of the patched functions."""

    def __init__(self) -> None:
        self._is_active = True
        self._all_wrappers: list[tuple[Any, str, Any]] = []

    def is_active(self) -> bool:
        """Whether the patched functions cast their arguments right now."""
        return self._is_active

    def _clear_cache(self) -> None:
        """Apex drops its per-iteration weight-cast cache here; the stand-in keeps none."""

    def _save_func(self, mod: Any, fn: str, func: Any) -> None:
        self._all_wrappers.append((mod, fn, func))

    def _deactivate(self) -> None:
        """Restore every patched function (Apex's teardown)."""
        for mod, fn, func in self._all_wrappers:
            setattr(mod, fn, func)
        self._all_wrappers = []
