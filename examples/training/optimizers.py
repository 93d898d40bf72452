"""Optimizers and schedules built from a run's `optim` and `schedule` sections.

`sgd` and `adamw` are torch's; `kfac` is `kfac_optim.KFAC`. Schedules are expressed in
epochs in the config and converted to optimizer steps here, once `steps_per_epoch` is known:
K-FAC's `{initial, epochs, gamma}` values become `kfac_optim.schedule.milestones.MilestoneSchedule`s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from examples.training.config import OptimConfig, ScheduleConfig, SetupError
from kfac_optim import KFAC, AsyncConfig, CurvatureConfig, MilestoneSchedule, RuntimeConfig, UpdateConfig
from kfac_optim.config import FLAT_KEYWORDS

_SCHEDULE_KEYS = frozenset({"initial", "epochs", "gamma"})


def kfac_kwargs(options: dict[str, Any], steps_per_epoch: int) -> dict[str, Any]:
    """Config values -> KFAC keyword arguments: schedules to callables, dtype names to dtypes, ``update``'s
    fields (``{trust_region: lr_squared}``) into ``update=``, and the settings of KFAC's configs
    (``fisher``, ``skip_layers``, ``async_statistics``, ...: the flat keys of
    ``kfac_optim.config.FLAT_KEYWORDS``) into ``curvature=``/``asynchronous=``/``runtime=``."""
    kwargs: dict[str, Any] = {}
    for key, value in options.items():
        if value is None:
            raise SetupError(f"optim.kfac.{key} is null: give it a value, or delete the key to use KFAC's default")
        if key == "update":
            value = UpdateConfig(**value)
        elif isinstance(value, dict):
            if set(value) != _SCHEDULE_KEYS:
                raise SetupError(f"optim.kfac.{key}: a schedule has exactly the keys {sorted(_SCHEDULE_KEYS)}; "
                                 f"got {sorted(value)}")
            value = MilestoneSchedule(value["initial"], tuple(round(e * steps_per_epoch) for e in value["epochs"]),
                                      value["gamma"])
        elif key.endswith("_dtype"):
            value = getattr(torch, value)
        elif key == "skip_layers":
            value = tuple(value)
        kwargs[key] = value
    grouped: dict[str, dict[str, Any]] = {}
    for key in [key for key in kwargs if key in FLAT_KEYWORDS]:
        argument, field = FLAT_KEYWORDS[key]
        grouped.setdefault(argument, {})[field] = kwargs.pop(key)
    configs = {"curvature": CurvatureConfig, "asynchronous": AsyncConfig, "runtime": RuntimeConfig}
    for argument, fields in grouped.items():
        kwargs[argument] = configs[argument](**fields)
    return kwargs


def build_optimizer(cfg: OptimConfig, model: nn.Module, steps_per_epoch: int) -> Optimizer:
    """The optimizer of `cfg` over `model` (unwrapped: K-FAC hooks its layers by module name)."""
    if cfg.kfac and cfg.name != "kfac":
        raise SetupError(f"optim.kfac options are only for optim.name=kfac (this run uses {cfg.name})")
    if cfg.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                               weight_decay=cfg.weight_decay, nesterov=cfg.nesterov)
    if cfg.name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    return KFAC(model, lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                weight_decay=cfg.weight_decay, nesterov=cfg.nesterov,
                **kfac_kwargs(cfg.kfac, steps_per_epoch))


@dataclass(frozen=True)
class LRFactor:
    """The LR multiplier of the optimizer step: linear warmup, then constant, step or cosine decay."""

    cfg: ScheduleConfig
    steps_per_epoch: int
    epochs: int

    def __call__(self, step: int) -> float:
        cfg, per_epoch = self.cfg, self.steps_per_epoch
        warmup = round(cfg.warmup_epochs * per_epoch)
        if step < warmup:
            return cfg.warmup_start + (1.0 - cfg.warmup_start) * (step + 1) / warmup
        if cfg.kind == "step":
            return cfg.gamma ** sum(step >= round(m * per_epoch) for m in cfg.milestones)
        if cfg.kind == "cosine":
            total = max(1, self.epochs * per_epoch - warmup)
            progress = min(1.0, (step - warmup) / total)
            return cfg.min_factor + (1.0 - cfg.min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0


def build_lr_scheduler(cfg: ScheduleConfig, optimizer: Optimizer, steps_per_epoch: int, epochs: int) -> LambdaLR:
    """A `LambdaLR` stepped once per optimizer step."""
    return LambdaLR(optimizer, LRFactor(cfg, steps_per_epoch, epochs))
