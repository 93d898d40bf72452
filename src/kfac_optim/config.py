"""``KFAC``'s settings as typed, frozen, validated values (docs/api.md "Configs").

Owns: the advanced settings grouped by what they are about, each checked when it is created
(``ValueError``/``TypeError`` naming the setting; a contradictory combination names both), the
one object of settings every rank must share (:class:`KFACOptions`), and the flat names of the
configs' fields (:data:`FLAT_KEYWORDS`, for code that reads flat settings such as a config file).
Must not know: how the settings are used (the estimator, the optimizer, the distributed layer).

- :class:`CurvatureConfig`: where the statistics come from and how they become factors
  (``fisher``, ``loss_reduction``, ``weight_sharing``, ``factor_decay``, ``stagger``, dtypes,
  which layers: ``skip_layers`` and a per-optimizer ``blocks`` override of the registry).
- :class:`AsyncConfig`: decompositions on a background worker (they change which decompositions a
  step uses, so every rank must agree on them).
- :class:`RuntimeConfig`: how this process carries the work out, never what it computes
  (process group, ``grad_worker_fraction``, bucket size, ``GradScaler``, the statistics thread):
  per process, so ranks may differ in all but ``grad_worker_fraction``, which the plan checks.

``KFACOptions`` = the five everyday K-FAC arguments + ``CurvatureConfig`` + ``AsyncConfig``: what
``distributed/consistency.py`` compares across ranks (:meth:`KFACOptions.rank_settings`).
- :class:`UpdateConfig`: how the preconditioned directions become the step (trust region,
  decoupled weight decay, grafting); part of ``KFACOptions``, every rank must share it.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kfac_optim.diagnostics import warn_user
from kfac_optim.distributed.comm import DEFAULT_BUCKET_BYTES
from kfac_optim.layers import ConvStatistics, KroneckerBlock
from kfac_optim.layers.conv_statistics import check_conv_statistics
from kfac_optim.layers.registry import SkipLayers, check_block_overrides
from kfac_optim.methods import Method, method_named
from kfac_optim.schedule.intervals import AutoIntervals, auto_of, check_interval
from kfac_optim.update.damping import AdaptiveDamping, check_damping

IntSchedule = int | Callable[[int], int] | Literal["auto"] | AutoIntervals
FloatSchedule = float | Callable[[int], float]
Damping = FloatSchedule | AdaptiveDamping



def check_hyperparameter(name: str, value: float | Tensor, minimum: float = 0.0) -> None:
    """A finite real number (or a 1-element tensor, for ``lr``) ``>= minimum``, else an error naming it."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a float or a 1-element tensor")
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not minimum <= float(value) < math.inf:
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value}")


def check_skip_layers(skip_layers: Any) -> tuple[str | type[nn.Module], ...]:
    """``skip_layers`` as a tuple of valid full-match regexes and module types, else an error naming it."""
    if isinstance(skip_layers, (str, type)) or not isinstance(skip_layers, Sequence | set | frozenset):
        raise TypeError(
            f"skip_layers must be a sequence of name patterns or module types, got {type(skip_layers).__name__}"
        )
    for rule in skip_layers:
        if isinstance(rule, str):
            try:
                re.compile(rule)
            except re.error as error:
                raise ValueError(f"skip_layers: {rule!r} is not a valid regular expression ({error})") from None
        elif not (isinstance(rule, type) and issubclass(rule, nn.Module)):
            raise TypeError(f"skip_layers entries must be str patterns or nn.Module subclasses, got {rule!r}")
    return tuple(skip_layers)


def _check_bool(owner: str, name: str, old_name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} ({old_name}) must be a bool, got {type(value).__name__}")


@dataclass(frozen=True)
class CurvatureConfig:
    """Where the statistics come from and how they become factors; every rank must share these.

    ``factor_decay``: weight of the old factor in the running average, in [0, 1).
    ``fisher``: "empirical" (G from the training loss's backward) or "sampled" (from
    :meth:`KFAC.sample_fisher`'s backward at targets drawn from the model).
    ``loss_reduction``: "mean" or "sum", how the training loss reduces over the batch (None:
    "mean"); it does not apply to ``fisher="sampled"``, whose loss is a sum (a ``ValueError`` there).
    ``weight_sharing``: "expand" or "reduce" (docs/numerics.md). ``conv_positions``: which output
    positions of a convolution become rows (``kfac_optim.layers.conv_statistics``: ``Expand()``,
    ``Reduce()``, ``SampledPositions(count, seed)``, ``ReduceAbove(positions)``), for every conv
    block whatever ``weight_sharing`` says (None: as ``weight_sharing`` says). ``stagger``: spread the blocks'
    factor updates over the steps of each factor interval (``kfac_optim.estimator.stagger``).
    ``factor_dtype``, ``inv_dtype``: float32 or float64 for factors and decompositions.
    ``skip_layers``: module-name regexes (full match against the name or the class name) or module
    types whose layers take the SGD path. ``blocks``: ``{module type: KroneckerBlock subclass}``,
    consulted before the global registry (``kfac_optim.register_block``) for this optimizer only.
    """

    factor_decay: float = 0.95
    fisher: Literal["empirical", "sampled"] = "empirical"
    loss_reduction: Literal["mean", "sum"] | None = None
    weight_sharing: Literal["expand", "reduce"] = "expand"
    conv_positions: ConvStatistics | None = None
    stagger: bool = False
    factor_dtype: torch.dtype = torch.float32
    inv_dtype: torch.dtype = torch.float32
    skip_layers: SkipLayers = ()
    blocks: Mapping[type[nn.Module], type[KroneckerBlock]] | None = None

    def __post_init__(self) -> None:
        check_hyperparameter("CurvatureConfig.factor_decay", self.factor_decay)
        if not 0 <= self.factor_decay < 1:
            raise ValueError(f"factor_decay must be in [0, 1), got {self.factor_decay}")
        if self.fisher not in ("empirical", "sampled"):
            raise ValueError(f"fisher must be 'empirical' or 'sampled', got {self.fisher!r}")
        if self.loss_reduction not in (None, "mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean', 'sum' or None, got {self.loss_reduction!r}")
        if self.loss_reduction is not None and self.fisher == "sampled":
            raise ValueError(
                f"CurvatureConfig(loss_reduction={self.loss_reduction!r}) does not apply to "
                "CurvatureConfig(fisher='sampled') (sample_fisher's loss is a sum over samples): leave "
                "loss_reduction None"
            )
        if self.weight_sharing not in ("expand", "reduce"):
            raise ValueError(f"weight_sharing must be 'expand' or 'reduce', got {self.weight_sharing!r}")
        check_conv_statistics(self.conv_positions, "CurvatureConfig.conv_positions")
        _check_bool("CurvatureConfig", "stagger", "stagger_factor_updates", self.stagger)
        for name in ("factor_dtype", "inv_dtype"):
            if getattr(self, name) not in (torch.float32, torch.float64):
                raise ValueError(f"{name} must be torch.float32 or torch.float64, got {getattr(self, name)}")
        object.__setattr__(self, "skip_layers", check_skip_layers(self.skip_layers))
        check_block_overrides(self.blocks)

    @property
    def reduction(self) -> Literal["mean", "sum"]:
        """How the batch's statistics are normalized at a fold: sample_fisher's loss is a sum."""
        if self.fisher == "sampled":
            return "sum"
        return self.loss_reduction or "mean"


@dataclass(frozen=True)
class AsyncConfig:
    """Decompositions on a background worker (a thread; on CUDA its own stream); every rank must share it.

    A round starts at a decomposition step with snapshots of the factors and is adopted at the next
    decomposition step, or ``delay`` (an int >= 1) steps after the one that started it if that
    comes first (None: at the next decomposition step).
    """

    delay: int | None = None

    def __post_init__(self) -> None:
        if self.delay is not None and (isinstance(self.delay, bool) or not isinstance(self.delay, int)):
            raise TypeError(f"async_delay must be an int or None, got {type(self.delay).__name__}")
        if self.delay is not None and self.delay < 1:
            raise ValueError(f"async_delay must be >= 1, got {self.delay}")


@dataclass(frozen=True)
class RuntimeConfig:
    """How this process carries out K-FAC's work, never what it computes; per process.

    ``grad_worker_fraction``: the distributed strategy (docs/design.md §5), KAISA's ``f`` in (0, 1]
    or "comm-opt" / "mem-opt" / "hybrid-opt"; every rank must share it (the plan checks it).
    ``process_group``: the group to run on (None: the whole job when ``torch.distributed`` is
    initialized with more than one rank, else one process). ``bucket_bytes``: the size of one
    flat buffer of the factor and decomposition collectives. ``grad_scaler``: the
    ``torch.amp.GradScaler`` of a loop that calls ``scaler.unscale_(optimizer)`` before
    ``scaler.step(optimizer)`` (see ``kfac_optim.precision``). ``async_statistics``: compute the
    statistics on a background thread (the same factors, only ready later).
    """

    grad_worker_fraction: float | str = 1.0
    process_group: dist.ProcessGroup | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    grad_scaler: torch.amp.GradScaler | None = None
    async_statistics: bool = False

    def __post_init__(self) -> None:
        _check_bool("RuntimeConfig", "async_statistics", "async_statistics", self.async_statistics)
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"RuntimeConfig.bucket_bytes must be an int >= 1, got {self.bucket_bytes!r}")


@dataclass(frozen=True)
class UpdateConfig:
    """How the preconditioned directions become the step (docs/design.md §4.1); every rank must share it.

    ``trust_region``: how ``kl_clip`` sets the step's length. "sgd" (the default): K-FAC's directions
    scaled by one ``ν = Σ lr‖∇‖² / Σ lr⟨V, ∇⟩`` over all K-FAC parameters, so the step ``lr·ν·V``
    promises the first-order decrease of SGD's ``lr·∇`` (each param group at its lr), then ``ν``
    lowered where the step's KL estimate ``Σ lr²ν²⟨V, ∇⟩`` would exceed ``kl_clip`` (a bound in nats
    that does not grow with the lr: a mistyped lr stays bounded). The lr scales the step as SGD's
    does, and a summed loss at ``lr/N`` (``CurvatureConfig(loss_reduction="sum")``) takes the step of
    the mean loss at ``lr`` (``kfac_optim.update.step_length.SGDDecrease``, docs/design.md §4.1).
    The KL clips (``kfac_optim.update.step_length.KLClip``) scale by ``ν = min(1, sqrt(kl_clip / |Σ lr₀² ⟨V, ∇⟩|))``:
    "lr_squared": at lr 1 (``lr₀ = 1``), so the applied step ``lr_t·ν·V`` has the KL bound
    ``kl_clip·lr_t²``. "base_lr": ν is
    computed at each param group's base lr (its ``"kfac_base_lr"``: its lr when the optimizer was
    built or the group added, see ``KFAC.trust_region_lr``), so while the clip binds the applied
    step ``lr_t·ν·V`` scales with the scheduled lr: the bound at ``lr_t`` is
    ``kl_clip·(lr_t / base_lr)²``, so the base lr cancels while the clip binds (``kl_clip=c`` there
    is ``kl_clip=c / base_lr²`` under "lr_squared" for one param group). "scheduled_lr": ν at the
    scheduled lr (the step does not follow a schedule while the clip binds).
    ``decoupled_weight_decay``: the group's ``weight_decay`` as ``p ← p·(1 − lr·weight_decay)``,
    outside the direction, momentum and clip (as ``torch.optim.AdamW``); False: SGD's coupled decay.
    ``grafting``: "sgd" or "adam": per parameter tensor, K-FAC's direction with the norm of that
    optimizer's step (``kfac_optim.update.grafting``); replaces the KL clip (``kl_clip`` must be None).
    ``adam_betas``, ``adam_eps``: Adam's, for ``grafting="adam"``.
    """

    trust_region: Literal["sgd", "lr_squared", "base_lr", "scheduled_lr"] = "sgd"
    decoupled_weight_decay: bool = False
    grafting: Literal["sgd", "adam"] | None = None
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.trust_region not in ("sgd", "lr_squared", "base_lr", "scheduled_lr"):
            raise ValueError("UpdateConfig.trust_region must be 'sgd', 'lr_squared', 'base_lr' or 'scheduled_lr', "
                             f"got {self.trust_region!r}")
        _check_bool("UpdateConfig", "decoupled_weight_decay", "decoupled_weight_decay", self.decoupled_weight_decay)
        if self.grafting not in (None, "sgd", "adam"):
            raise ValueError(f"UpdateConfig.grafting must be 'sgd', 'adam' or None, got {self.grafting!r}")
        if not (isinstance(self.adam_betas, tuple) and len(self.adam_betas) == 2
                and all(isinstance(b, numbers.Real) and 0 <= b < 1 for b in self.adam_betas)):
            raise ValueError(f"UpdateConfig.adam_betas must be a pair of numbers in [0, 1), got {self.adam_betas!r}")
        check_hyperparameter("UpdateConfig.adam_eps", self.adam_eps)
        if self.adam_eps <= 0:
            raise ValueError(f"UpdateConfig.adam_eps must be > 0, got {self.adam_eps}")
        if (self.grafting != "adam"
                and (self.adam_betas, self.adam_eps) != (UpdateConfig.adam_betas, UpdateConfig.adam_eps)):
            raise ValueError(
                "UpdateConfig.adam_betas/adam_eps are Adam's, used only with grafting='adam' "
                f"(grafting={self.grafting!r})"
            )


@dataclass(frozen=True)
class KFACOptions:
    """The K-FAC settings every rank must share (the SGD ones live in ``param_groups``), validated.

    ``damping``: λ, in Fisher units of a per-sample loss (docs/numerics.md), a float > 0, a
    callable ``step -> float`` or an ``AdaptiveDamping`` (Levenberg–Marquardt,
    ``kfac_optim.update.damping``). ``kl_clip``: the bound on the step's KL estimate ν is computed from
    (``UpdateConfig.trust_region``; None: no scaling). ``factor_update_steps`` /
    ``decomposition_update_steps``: fold statistics / refresh decompositions every this many steps
    (int >= 1 or callable ``step -> int``), or ``"auto"`` / an ``AutoIntervals`` (the default):
    chosen from the cost counted from shapes, or a ``MeasuredIntervals``: from the cost timed on the
    first steps (``kfac_optim.schedule.intervals``). ``method``: "eigen", "inverse", "eigen_adam",
    "root" or a ``kfac_optim.Method``. ``curvature``, ``asynchronous``, ``update``: see
    :class:`CurvatureConfig`, :class:`AsyncConfig` (None: decompositions in line) and :class:`UpdateConfig`.
    """

    damping: Damping = 0.1
    kl_clip: float | None = 1e-2
    factor_update_steps: IntSchedule = "auto"
    decomposition_update_steps: IntSchedule = "auto"
    method: Literal["eigen", "inverse", "eigen_adam", "root"] | Method = "eigen"
    curvature: CurvatureConfig = field(default_factory=CurvatureConfig)
    asynchronous: AsyncConfig | None = None
    update: UpdateConfig = field(default_factory=UpdateConfig)

    def __post_init__(self) -> None:
        if isinstance(self.damping, AdaptiveDamping):
            self._check_adaptive_damping()
        elif not callable(self.damping):
            check_damping(self.damping)
        if self.kl_clip is not None and not 0 < self.kl_clip < math.inf:
            raise ValueError(f"kl_clip must be a finite number > 0 or None, got {self.kl_clip}")
        auto = auto_of(self.factor_update_steps, self.decomposition_update_steps)  # ValueError naming them
        for name in ("factor_update_steps", "decomposition_update_steps"):
            if not callable(getattr(self, name)) and not isinstance(getattr(self, name), (str, AutoIntervals)):
                check_interval(name, getattr(self, name))
        method_named(self.method)  # ValueError naming method
        if not isinstance(self.curvature, CurvatureConfig):
            raise TypeError(f"curvature must be a CurvatureConfig, got {type(self.curvature).__name__}")
        if self.asynchronous is not None and not isinstance(self.asynchronous, AsyncConfig):
            raise TypeError(f"asynchronous must be an AsyncConfig or None, got {type(self.asynchronous).__name__}")
        if not isinstance(self.update, UpdateConfig):
            raise TypeError(f"update must be an UpdateConfig, got {type(self.update).__name__}")
        if self.update.grafting is not None and self.kl_clip is not None:
            raise ValueError(
                f"UpdateConfig.grafting={self.update.grafting!r} sets the step length itself and replaces the KL clip: "
                f"pass kl_clip=None (got kl_clip={self.kl_clip})"
            )
        if self.curvature.stagger and auto is not None and isinstance(self.factor_update_steps, (str, AutoIntervals)):
            raise ValueError(
                "CurvatureConfig.stagger (stagger_factor_updates) needs an explicit factor_update_steps > 1 (not "
                f"{self.factor_update_steps!r}): its phases are assigned per interval"
            )
        if self.curvature.stagger and self.factor_update_steps == 1:
            raise ValueError(
                "CurvatureConfig.stagger (stagger_factor_updates) needs factor_update_steps > 1: at an interval "
                "of 1 every layer folds on every step, there is nothing to spread"
            )
        factor, inverse = self.factor_update_steps, self.decomposition_update_steps
        if isinstance(factor, int) and isinstance(inverse, int) and inverse % factor:
            warn_user(  # KAISA warns too: valid, but some decompositions see no new factors
                f"decomposition_update_steps={inverse} is not a multiple of factor_update_steps={factor}: "
                "some decomposition steps decompose the factors of an earlier one again",
            )

    def _check_adaptive_damping(self) -> None:
        """``AdaptiveDamping`` needs a method that uses λ and the Fisher of a mean loss (its model's units)."""
        method = method_named(self.method)
        if not method.uses_damping:
            raise ValueError(
                f"damping={self.damping!r} adapts λ, which method={method.name!r} does not use: choose method='eigen' "
                "or 'inverse', or a constant damping"
            )
        if self.curvature.loss_reduction == "sum":
            raise ValueError(
                f"damping={self.damping!r} compares the loss change with a model in the units of a mean-reduced loss: "
                "CurvatureConfig(loss_reduction='sum') is not supported with it"
            )

    def rank_settings(self) -> dict[str, object]:
        """``{name: value}`` of every setting, the same names on every rank whatever they chose (the
        digests are gathered in this order): what ``distributed/consistency.py`` compares across
        ranks. ``CurvatureConfig``'s fields as ``"curvature.fisher"``, but for ``skip_layers`` and
        ``blocks``, whose effect the check compares as the layer list; ``AsyncConfig`` as
        ``"asynchronous"`` (whether one is given) and ``"asynchronous.delay"``."""
        asynchronous = self.asynchronous
        return {
            "damping": self.damping,
            "kl_clip": self.kl_clip,
            "factor_update_steps": self.factor_update_steps,
            "decomposition_update_steps": self.decomposition_update_steps,
            "method": self.method,
            **{f"curvature.{f.name}": getattr(self.curvature, f.name) for f in fields(self.curvature)
               if f.name not in _COMPARED_AS_LAYERS},
            "asynchronous": asynchronous is not None,
            "asynchronous.delay": None if asynchronous is None else asynchronous.delay,
            **{f"update.{f.name}": getattr(self.update, f.name) for f in fields(self.update)},
        }


_COMPARED_AS_LAYERS = ("skip_layers", "blocks")

_CURVATURE_KEYWORDS = {
    "factor_decay": "factor_decay",
    "loss_reduction": "loss_reduction",
    "fisher": "fisher",
    "weight_sharing": "weight_sharing",
    "stagger_factor_updates": "stagger",
    "factor_dtype": "factor_dtype",
    "inv_dtype": "inv_dtype",
    "skip_layers": "skip_layers",
}
_ASYNC_KEYWORDS = {"async_delay": "delay"}
_RUNTIME_KEYWORDS = {
    "grad_worker_fraction": "grad_worker_fraction",
    "process_group": "process_group",
    "grad_scaler": "grad_scaler",
    "async_statistics": "async_statistics",
}
FLAT_KEYWORDS: dict[str, tuple[str, str]] = {
    **{old: ("curvature", new) for old, new in _CURVATURE_KEYWORDS.items()},
    **{old: ("asynchronous", new) for old, new in _ASYNC_KEYWORDS.items()},
    **{old: ("runtime", new) for old, new in _RUNTIME_KEYWORDS.items()},
}
"""``{flat name: (the KFAC argument of its config, the field)}``, for code that translates flat
settings (a training config file's keys) into configs."""
