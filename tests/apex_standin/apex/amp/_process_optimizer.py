"""Patches Amp applies to an optimizer (follows ``apex/amp/_process_optimizer.py``, non-fused).

With master weights (O2), lazy init replaces every fp16 param in ``param_groups`` by an fp32
clone; ``_amp_stash.all_fp16_params[i]`` (the model's own Parameter objects) and
``_amp_stash.all_fp32_from_fp16_params[i]`` (the masters) are built in the same loop, so they
correspond index by index. Without master weights (O1) params stay the model's.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from .scaler import LossScaler


class AmpOptimizerState:
    """``optimizer._amp_stash``: the Amp bookkeeping attached to a processed optimizer."""


def _master_params_to_model_params(self: torch.optim.Optimizer) -> None:
    stash = self._amp_stash
    for model, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        model.data.copy_(master.data)


def lazy_init_with_master_weights(self: torch.optim.Optimizer) -> None:
    """Swap fp16 params for fp32 masters in ``param_groups``; recast state via a state_dict trip."""
    stash = self._amp_stash
    stash.fp16_groups, stash.fp32_from_fp16_groups, stash.fp32_from_fp32_groups = [], [], []
    for param_group in self.param_groups:
        fp16_params, fp32_params, fp32_from_fp16_params = [], [], []
        for i, param in enumerate(param_group["params"]):
            if not param.requires_grad:
                continue
            if param.dtype == torch.float16:
                fp16_params.append(param)
                master_param = param.detach().clone().float()
                master_param.requires_grad = True
                param_group["params"][i] = master_param
                fp32_from_fp16_params.append(master_param)
                if param in self.state:
                    self.state[master_param] = self.state.pop(param)
            elif param.dtype == torch.float32:
                fp32_params.append(param)
            else:
                raise TypeError(
                    "Optimizer's parameters must be either torch.cuda.FloatTensor or "
                    f"torch.cuda.HalfTensor. Received {param.type()}"
                )
        stash.fp16_groups.append(fp16_params)
        stash.fp32_from_fp16_groups.append(fp32_from_fp16_params)
        stash.fp32_from_fp32_groups.append(fp32_params)
    stash.all_fp16_params = [p for g in stash.fp16_groups for p in g]
    stash.all_fp32_from_fp16_params = [p for g in stash.fp32_from_fp16_groups for p in g]
    stash.all_fp32_from_fp32_params = [p for g in stash.fp32_from_fp32_groups for p in g]
    stash.all_fp32_from_fp32_grad_stash = [None for _ in stash.all_fp32_from_fp32_params]
    for param in stash.all_fp32_from_fp16_params + stash.all_fp32_from_fp32_params:
        param.grad = None
    self.load_state_dict(self.state_dict())


def post_backward_models_are_masters(
    scaler: LossScaler, params: list[torch.Tensor], stashed_grads: list[torch.Tensor | None]
) -> None:
    """Unscale grads in place, adding a grad stashed before this backward, then clear the stash."""
    fresh, with_stash, stashed = [], [], []
    for param, stashed_grad in zip(params, stashed_grads):
        if param.grad is None and stashed_grad is not None:
            param.grad = stashed_grad
        elif param.grad is not None and stashed_grad is None:
            fresh.append(param.grad)
        elif param.grad is not None and stashed_grad is not None:
            with_stash.append(param.grad)
            stashed.append(stashed_grad)
    if fresh:
        scaler.unscale(fresh, fresh, scaler.loss_scale(), models_are_masters=True)
    if with_stash:
        scaler.unscale_with_stashed(with_stash, stashed, with_stash)
    for i in range(len(stashed_grads)):
        stashed_grads[i] = None


def prepare_backward_with_master_weights(self: torch.optim.Optimizer) -> None:
    """Before backward: fp16 model grads to None; stash and clear fp32-param grads."""
    stash = self._amp_stash
    self._amp_lazy_init()
    for param in stash.all_fp16_params:
        param.grad = None
    for i, param in enumerate(stash.all_fp32_from_fp32_params):
        stash.all_fp32_from_fp32_grad_stash[i] = param.grad
        param.grad = None


def post_backward_with_master_weights(self: torch.optim.Optimizer, scaler: LossScaler) -> None:
    """After backward: fp16 model grads / scale -> fp32 master grads (accumulating if present)."""
    stash = self._amp_stash
    self._amp_lazy_init()
    new_model, new_master, acc_model, acc_master = [], [], [], []
    for fp16_param, fp32_param in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        if fp16_param.grad is not None and fp32_param.grad is None:
            fp32_param.grad = torch.empty_like(fp32_param)
            new_model.append(fp16_param.grad)
            new_master.append(fp32_param.grad)
        elif fp16_param.grad is not None:
            acc_model.append(fp16_param.grad)
            acc_master.append(fp32_param.grad)
    if new_model:
        scaler.unscale(new_model, new_master, scaler.loss_scale(), models_are_masters=False)
    if acc_model:
        scaler.unscale_with_stashed(acc_model, acc_master, acc_master)
    post_backward_models_are_masters(
        scaler, stash.all_fp32_from_fp32_params, stash.all_fp32_from_fp32_grad_stash
    )


def lazy_init_no_master_weights(self: torch.optim.Optimizer) -> None:
    """Sort the optimizer's own params into fp16 and fp32 lists (O1)."""
    stash = self._amp_stash
    stash.all_fp16_params, stash.all_fp32_params = [], []
    for param_group in self.param_groups:
        for param in param_group["params"]:
            if param.dtype == torch.float16:
                stash.all_fp16_params.append(param)
            elif param.dtype == torch.float32:
                stash.all_fp32_params.append(param)
            else:
                raise TypeError(
                    "Optimizer's parameters must be either torch.cuda.FloatTensor or "
                    f"torch.cuda.HalfTensor. Received {param.type()}"
                )
    stash.all_fp16_grad_stash = [None for _ in stash.all_fp16_params]
    stash.all_fp32_grad_stash = [None for _ in stash.all_fp32_params]


def prepare_backward_no_master_weights(self: torch.optim.Optimizer) -> None:
    """Before backward: stash every param's grad and set it to None."""
    stash = self._amp_stash
    self._amp_lazy_init()
    for params, grad_stash in (
        (stash.all_fp16_params, stash.all_fp16_grad_stash),
        (stash.all_fp32_params, stash.all_fp32_grad_stash),
    ):
        for i, param in enumerate(params):
            grad_stash[i] = param.grad
            param.grad = None


def post_backward_no_master_weights(self: torch.optim.Optimizer, scaler: LossScaler) -> None:
    """After backward: unscale every param's grad in place (plus its stashed grad)."""
    stash = self._amp_stash
    self._amp_lazy_init()
    post_backward_models_are_masters(scaler, stash.all_fp16_params, stash.all_fp16_grad_stash)
    post_backward_models_are_masters(scaler, stash.all_fp32_params, stash.all_fp32_grad_stash)


def _amp_lazy_init(self: torch.optim.Optimizer) -> None:
    if not self._amp_stash.lazy_init_called:
        self._lazy_init_maybe_master_weights()
        self._amp_stash.lazy_init_called = True


def _process_optimizer(
    optimizer: torch.optim.Optimizer, properties: Any
) -> torch.optim.Optimizer:
    """Attach ``_amp_stash`` and the backward hooks; for master weights patch step, zero_grad."""
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    optimizer._amp_stash = AmpOptimizerState()
    optimizer._amp_stash.lazy_init_called = False
    optimizer._amp_stash.already_patched = False
    optimizer._amp_stash.params_have_scaled_gradients = False
    for name in (
        "_lazy_init_maybe_master_weights",
        "_master_params_to_model_params",
        "_prepare_amp_backward",
        "_post_amp_backward",
        "_amp_lazy_init",
    ):
        if hasattr(optimizer, name):
            raise RuntimeError(f"Incoming optimizer already has {name} defined.")

    def bind(fn: Any) -> types.MethodType:
        return types.MethodType(fn, optimizer)

    if properties.master_weights:
        optimizer._lazy_init_maybe_master_weights = bind(lazy_init_with_master_weights)
        optimizer._master_params_to_model_params = bind(_master_params_to_model_params)
        old_step = optimizer.step

        def new_step(self: torch.optim.Optimizer) -> Any:
            retval = old_step()
            self._master_params_to_model_params()
            for param in self._amp_stash.all_fp32_from_fp16_params:
                param.grad = None
            return retval

        def new_zero_grad(self: torch.optim.Optimizer) -> None:
            stash = self._amp_stash
            self._amp_lazy_init()
            for param in stash.all_fp16_params + stash.all_fp32_from_fp32_params:
                if param.grad is not None:
                    param.grad.detach_()
                    param.grad.zero_()
            for param in stash.all_fp32_from_fp16_params:
                param.grad = None

        optimizer.step = bind(new_step)
        optimizer.zero_grad = bind(new_zero_grad)
        optimizer._prepare_amp_backward = bind(prepare_backward_with_master_weights)
        optimizer._post_amp_backward = bind(post_backward_with_master_weights)
    else:
        optimizer._lazy_init_maybe_master_weights = bind(lazy_init_no_master_weights)
        optimizer._prepare_amp_backward = bind(prepare_backward_no_master_weights)
        optimizer._post_amp_backward = bind(post_backward_no_master_weights)
    optimizer._amp_lazy_init = bind(_amp_lazy_init)
    return optimizer
