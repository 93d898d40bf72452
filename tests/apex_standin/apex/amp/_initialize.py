"""What ``amp.initialize`` does to models and optimizers (follows ``apex/amp/_initialize.py``).

Also carries ``convert_network`` from ``apex/fp16_utils/fp16util.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import MethodType
from typing import Any

import torch

from ._amp_state import _amp_state, warn_or_err
from ._process_optimizer import _process_optimizer
from .amp import init as amp_init
from .handle import disable_casts
from .scaler import LossScaler


def to_type(dtype: torch.dtype, t: Any) -> Any:
    """Cast a floating tensor (or anything with ``.to``) to ``dtype``."""
    if isinstance(t, torch.Tensor) and not t.is_floating_point():
        return t
    return t.to(dtype)


def applier(value: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every tensor in a nest of mappings and iterables (strings left alone)."""
    if isinstance(value, torch.Tensor) or (not isinstance(value, str) and hasattr(value, "to")):
        return fn(value)
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return {applier(k, fn): applier(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(applier(v, fn) for v in value)
    return value


def convert_network(network: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast params (``.data``, so Parameter objects survive) and buffers; skip affine BatchNorm."""
    for module in network.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.affine:
            continue
        for param in module.parameters(recurse=False):
            if param.data.dtype.is_floating_point:
                param.data = param.data.to(dtype=dtype)
            if param._grad is not None and param._grad.data.dtype.is_floating_point:
                param._grad.data = param._grad.data.to(dtype=dtype)
        for buf in module.buffers(recurse=False):
            if buf.data.dtype.is_floating_point:
                buf.data = buf.data.to(dtype=dtype)
    return network


def check_models(models: list[torch.nn.Module]) -> None:
    """Refuse models already wrapped in DataParallel/DistributedDataParallel."""
    for model in models:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            raise RuntimeError(
                f"Incoming model is an instance of {type(model).__name__}. Parallel wrappers "
                "should only be applied to the model(s) AFTER the model(s) have been returned "
                "from amp.initialize."
            )


def check_params_fp32(models: list[torch.nn.Module]) -> None:
    """Refuse models whose floating params or buffers are not fp32 (Apex: not cuda float)."""
    for model in models:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                warn_or_err(
                    f"Found param {name} with type {tensor.type()}, expected "
                    "torch.cuda.FloatTensor.\nWhen using amp.initialize, you do not need to "
                    "call .half() on your model\nbefore passing it, no matter what optimization "
                    "level you choose."
                )


class O2StateDictHook:
    """Make ``model.state_dict()`` of a cast model return fp32 copies of fp16 entries."""

    def __call__(
        self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local: Any
    ) -> None:
        for key, value in state_dict.items():
            if value.dtype == torch.float16:
                state_dict[key] = value.to(torch.float32)


def _patch_forward(
    model: torch.nn.Module, input_caster: Callable[[Any], Any] | None, output_caster: Callable
) -> None:
    old_fwd = model.forward

    def new_fwd(*args: Any, **kwargs: Any) -> Any:
        if input_caster is not None:
            args, kwargs = applier(args, input_caster), applier(kwargs, input_caster)
        return applier(old_fwd(*args, **kwargs), output_caster)

    model.forward = new_fwd


def _step_without_casts(old_step: Callable[..., Any]) -> Callable[..., Any]:
    """O1: run the optimizer step with the function casts turned off."""

    def new_step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        with disable_casts():
            return old_step(*args, **kwargs)

    return new_step


def _initialize(
    models: torch.nn.Module | list[torch.nn.Module],
    optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer] | None,
    properties: Any,
    num_losses: int = 1,
    cast_model_outputs: torch.dtype | None = None,
) -> Any:
    """Cast and patch the models, process the optimizers, create the loss scalers."""
    optimizers_was_list = isinstance(optimizers, list)
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    elif optimizers is None:
        optimizers = []
    elif not optimizers_was_list:
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers.")
    models_was_list = isinstance(models, list)
    if isinstance(models, torch.nn.Module):
        models = [models]
    elif not models_was_list:
        raise TypeError("models must be either a single model or a list of models.")

    check_models(models)
    if not _amp_state.allow_incoming_model_not_fp32:
        check_params_fp32(models)

    if properties.cast_model_type:
        for model in models:
            if properties.keep_batchnorm_fp32:
                convert_network(model, properties.cast_model_type)
            else:
                model.to(properties.cast_model_type)
            _patch_forward(
                model,
                functools.partial(to_type, properties.cast_model_type),
                functools.partial(to_type, cast_model_outputs or torch.float32),
            )
        for optimizer in optimizers:
            optimizer.load_state_dict(optimizer.state_dict())
        for model in models:
            for module in model.modules():
                module._register_state_dict_hook(O2StateDictHook())
    elif cast_model_outputs is not None:
        for model in models:
            _patch_forward(model, None, functools.partial(to_type, cast_model_outputs))

    for i, optimizer in enumerate(optimizers):
        optimizers[i] = _process_optimizer(optimizer, properties)

    _amp_state.loss_scalers = [
        LossScaler(
            properties.loss_scale,
            min_loss_scale=_amp_state.min_loss_scale,
            max_loss_scale=_amp_state.max_loss_scale,
        )
        for _ in range(num_losses)
    ]

    if properties.patch_torch_functions:
        amp_init()
        for optimizer in optimizers:
            optimizer.step = MethodType(_step_without_casts(optimizer.step), optimizer)

    model_out = models if models_was_list else models[0]
    if optimizers_was_list:
        return model_out, optimizers
    if not optimizers:
        return model_out
    return model_out, optimizers[0]
