"""Module-level Amp state shared by the stand-in (follows ``apex/amp/_amp_state.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .handle import AmpHandle
    from .scaler import LossScaler


class AmpState:
    """Attribute stash; ``loss_scalers``, ``opt_properties`` and ``handle`` appear only once set.

    As in Apex, ``handle`` exists only after an O1 ``amp.initialize`` (``patch_torch_functions``).
    """

    loss_scalers: list[LossScaler]
    opt_properties: Any
    handle: AmpHandle
    min_loss_scale: float | None
    max_loss_scale: float

    def __init__(self) -> None:
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1


_amp_state = AmpState()


def warn_or_err(msg: str) -> None:
    """Raise ``RuntimeError(msg)``, or print it when ``hard_override`` is set."""
    if _amp_state.hard_override:
        print("Warning:  " + msg)
    else:
        raise RuntimeError(msg)


def maybe_print(msg: str) -> None:
    """Print ``msg`` unless ``verbosity`` is 0."""
    if _amp_state.verbosity > 0:
        print(msg)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Yield the params the optimizer owns: the fp32 masters under O2, after lazy init."""
    for group in optimizer.param_groups:
        yield from group["params"]
