"""``amp.initialize``, opt levels and ``amp.state_dict`` (follows ``apex/amp/frontend.py``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ._amp_state import _amp_state
from ._initialize import _initialize

_OPT_LEVELS: dict[str, dict[str, Any]] = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}


class Properties:
    """The options of one ``amp.initialize`` call (``_amp_state.opt_properties``)."""

    def __init__(self) -> None:
        self.enabled = False
        self.opt_level: str | None = None
        self.cast_model_type: torch.dtype | None = None
        self.patch_torch_functions = False
        self.keep_batchnorm_fp32: bool | None = None
        self.master_weights: bool | None = None
        self.loss_scale: float | str = 1.0

    def set(self, name: str, value: Any) -> None:
        """Set one option with Apex's coercions of string values."""
        if name == "loss_scale" and value != "dynamic":
            value = float(value)
        if name == "keep_batchnorm_fp32" and value in ("True", "False"):
            value = value == "True"
        setattr(self, name, value)


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> Any:
    """Apply ``opt_level`` and any non-None overrides; return the model(s) and optimizer(s)."""
    _amp_state.opt_properties = Properties()
    _amp_state.verbosity = verbosity
    if not enabled:
        return models if optimizers is None else (models, optimizers)
    if opt_level not in _OPT_LEVELS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'."
        )
    properties = _amp_state.opt_properties
    properties.enabled = True
    properties.opt_level = opt_level
    for name, value in _OPT_LEVELS[opt_level].items():
        properties.set(name, value)
    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale
    overrides = dict(
        cast_model_type=cast_model_type,
        patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        master_weights=master_weights,
        loss_scale=loss_scale,
    )
    for name, value in overrides.items():
        if value is not None:
            properties.set(name, value)
    return _initialize(models, optimizers, properties, num_losses, cast_model_outputs)


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"loss_scaler<i>": {"loss_scale": float, "unskipped": int}}`` for every loss scaler."""
    if destination is None:
        destination = OrderedDict()
    for idx, loss_scaler in enumerate(_amp_state.loss_scalers):
        destination[f"loss_scaler{idx}"] = {
            "loss_scale": loss_scaler.loss_scale(),
            "unskipped": loss_scaler._unskipped,
        }
    return destination


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore the loss scalers in order; keys without ``loss_scaler`` are an error."""
    if len(state_dict) != len(_amp_state.loss_scalers):
        print(
            f"Warning: state_dict contains {len(state_dict)} entries, while "
            f"{len(_amp_state.loss_scalers)} loss_scalers are used"
        )
    unexpected_keys = []
    idx = 0
    for key, value in state_dict.items():
        if "loss_scaler" not in key:
            unexpected_keys.append(key)
        else:
            if idx > len(_amp_state.loss_scalers) - 1:
                print(f"Skipping loss_scaler[{idx}], since num_losses was set to "
                      f"{len(_amp_state.loss_scalers)}")
                break
            _amp_state.loss_scalers[idx]._loss_scale = value["loss_scale"]
            _amp_state.loss_scalers[idx]._unskipped = value["unskipped"]
            idx += 1
    if unexpected_keys:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: "
            + ", ".join(f'"{k}"' for k in unexpected_keys)
            + ". "
        )
