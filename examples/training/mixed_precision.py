"""Mixed precision for the training loop: `--amp none|fp16|bf16|apex-O1|apex-O2`.

- `fp16`: `torch.autocast` to float16 and a `torch.amp.GradScaler`; `scaler.step(optimizer)`.
- `bf16`: `torch.autocast` to bfloat16, no loss scaling.
- `apex-O1`, `apex-O2`: NVIDIA Apex's legacy `amp` (`amp.initialize`, `amp.scale_loss`); needs
  CUDA and an Apex build that still ships `apex.amp` (releases up to 25.05).

Owns the autocast context, the backward and the optimizer step; knows nothing of the model.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from examples.training.config import SetupError


def import_apex_amp(mode: str) -> ModuleType:
    """`apex.amp`, or a SetupError saying why `--amp <mode>` cannot run here."""
    try:
        from apex import amp
    except ImportError as err:
        raise SetupError(
            f"--amp {mode} needs NVIDIA Apex's legacy amp (apex.amp, shipped by Apex releases up to 25.05), "
            f"which cannot be imported here ({err}); install such an Apex build with CUDA, "
            "or use --amp fp16 / --amp bf16 (native torch.amp)"
        ) from err
    return amp


def check_supported(mode: str, device: torch.device) -> None:
    """Raise a clear error before training when `mode` cannot run on `device`."""
    if mode.startswith("apex"):
        import_apex_amp(mode)
        if device.type != "cuda":
            raise SetupError(f"--amp {mode} needs a CUDA device (Apex amp is CUDA-only); this run is on {device}")


class Precision:
    """Autocast, backward, step and state for one run's `--amp` mode."""

    def __init__(self, mode: str, device: torch.device) -> None:
        check_supported(mode, device)
        self.mode = mode
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if mode == "fp16" else None
        self._apex = import_apex_amp(mode) if mode.startswith("apex") else None

    def initialize(self, model: nn.Module, optimizer: Optimizer) -> tuple[nn.Module, Optimizer]:
        """Apex's `amp.initialize` (before any DDP wrapping); the identity for the other modes."""
        if self._apex is None:
            return model, optimizer
        return self._apex.initialize(model, optimizer, opt_level=self.mode.removeprefix("apex-"), verbosity=0)

    def autocast(self) -> AbstractContextManager[Any]:
        """The forward-pass context: native autocast for fp16/bf16 (Apex casts on its own)."""
        dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
        if self.mode not in dtypes:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=dtypes[self.mode])

    def backward(self, loss: Tensor, optimizer: Optimizer, last_micro_batch: bool) -> None:
        """Backward of `loss`, scaled as the mode requires; Apex unscales only on the last micro-batch."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        elif self._apex is not None:
            with self._apex.scale_loss(loss, optimizer, delay_unscale=not last_micro_batch) as scaled:
                scaled.backward()
        else:
            loss.backward()

    def step(self, optimizer: Optimizer) -> None:
        """The optimizer step (through the GradScaler for fp16, which may skip it on inf/NaN)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """Loss-scaler state for checkpoints (empty for modes without one)."""
        if self.scaler is not None:
            return {"scaler": self.scaler.state_dict()}
        if self._apex is not None:
            return {"apex": self._apex.state_dict()}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved."""
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if self._apex is not None and "apex" in state:
            self._apex.load_state_dict(state["apex"])
