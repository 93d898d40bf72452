"""The step's length: what turns K-FAC's preconditioned directions into the directions SGD's update
applies (docs/design.md §4.1). One owner, chosen once at construction by :func:`step_length_for`
from the public settings: the KL clip (:class:`KLClip`, ``kl_clip=``), an SGD or Adam graft
(``UpdateConfig(grafting=...)``, :class:`kfac_optim.grafting.SGDGraft` / ``AdamGraft``) or none
(:class:`NoClip`, ``kl_clip=None``).

Owns: the :class:`StepLength` interface and the choice; the KL clip's ν, its sum over FSDP2
shards and its count of non-finite directions; the trust-region lr ``lr₀`` of each param group
(:class:`TrustRegion`, ``UpdateConfig.trust_region``) with its base lr and the zero-base-lr warning.
Must not know: the curvature or the blocks (it is handed the parameters in block order, the
sharding and the counter the estimator reports), SGD's update, schedules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor
from torch.profiler import record_function

from kfac_optim.config import KFACOptions
from kfac_optim.diagnostics import warn_user
from kfac_optim.distributed import fsdp
from kfac_optim.grafting import AdamGraft, SGDGraft

if TYPE_CHECKING:
    from kfac_optim.distributed.sharding import Sharding

__all__ = ["KLClip", "NoClip", "StepLength", "TrustRegion", "step_length_for"]

logger = logging.getLogger(__name__)


class StepLength(Protocol):
    """Sets the length of the step from K-FAC's directions, once per step."""

    def apply(self, directions: dict[Tensor, Tensor], groups: list[dict[str, Any]],
              state: dict[Tensor, dict[str, Any]]) -> dict[Tensor, Tensor]:
        """The directions SGD's update applies, by parameter (``directions``: K-FAC's ``V`` by
        parameter, possibly scaled in place; ``groups``: the optimizer's param groups; ``state``:
        its per-parameter state). A parameter left out takes its gradient (SGD's path)."""
        ...


class NoClip:
    """``kl_clip=None`` without grafting: K-FAC's directions as they are."""

    def apply(self, directions: dict[Tensor, Tensor], groups: list[dict[str, Any]],
              state: dict[Tensor, dict[str, Any]]) -> dict[Tensor, Tensor]:
        return directions


def _copy_lr(lr: float | Tensor) -> float | Tensor:
    """A param group's lr as its base lr: a float as is, a tensor lr cloned (a scheduler updates it in place)."""
    return lr.clone() if isinstance(lr, Tensor) else lr


class TrustRegion:
    """The lr at which the KL bound ``kl_clip`` holds for a param group (``UpdateConfig.trust_region``).

    Built before the optimizer's param groups (it sees each one added: :meth:`add_group`).
    """

    def __init__(self, kl_clip: float | None, rule: str) -> None:
        self.kl_clip = kl_clip
        self.rule = rule
        self._warned_zero_base_lr = False

    def add_group(self, group: dict[str, Any], index: int) -> None:
        """Save the group's lr now as its base lr, ``"kfac_base_lr"`` (unless the group names one),
        and warn once when the clip is computed at a base lr of 0 (ν = 1 always)."""
        group.setdefault("kfac_base_lr", _copy_lr(group["lr"]))
        if (self._warned_zero_base_lr or self.kl_clip is None or self.rule != "base_lr"
                or float(group["kfac_base_lr"]) != 0.0):
            return
        self._warned_zero_base_lr = True
        warn_user(
            f"param group {index} has lr=0 when added to KFAC: the KL clip (kl_clip="
            f"{self.kl_clip}) bounds each step at the group's base lr, its lr when it was added, and at 0 it "
            "never clips (ν = 1), so once a hand-written warmup raises the lr the steps are unclipped (tens of times "
            "those of a run built at the peak lr). Build KFAC at the peak lr and warm up with a scheduler "
            "(torch.optim.lr_scheduler.LambdaLR or LinearLR), which keeps the base lr; or set the group's "
            "'kfac_base_lr' to the peak lr (docs/design.md §4.1)"
        )

    def lr(self, group: dict[str, Any]) -> float | Tensor:
        """``lr₀`` of ``group``: "lr_squared" (the default) 1; "scheduled_lr" its lr; "base_lr" its
        ``"kfac_base_lr"`` (a group loaded from a state dict of an earlier release gets its
        ``"initial_lr"``, set by ``torch.optim.lr_scheduler``, else its lr now)."""
        if self.rule == "lr_squared":
            return 1.0
        if self.rule == "scheduled_lr":
            return group["lr"]
        if "kfac_base_lr" not in group:
            group["kfac_base_lr"] = _copy_lr(group.get("initial_lr", group["lr"]))
        return group["kfac_base_lr"]


class KLClip:
    """``kl_clip=c``: every direction scaled by ``ν = min(1, sqrt(c / |Σ lr₀² ⟨d, ∇p⟩|))`` in place.

    ``lr₀`` is the parameter's group's :meth:`TrustRegion.lr` (1 under the default
    ``trust_region="lr_squared"``), so the bound on the applied step ``lr·ν·d`` at the scheduled
    ``lr`` is ``c·(lr/lr₀)²`` (docs/design.md §4.1).

    The sum runs over the layers whose term is finite: a layer with a non-finite gradient has a
    non-finite direction (its preconditioner mixes all its entries) and is left out, so one bad
    entry cannot make every layer's update non-finite through ν. Such steps are counted on the
    device in ``nonfinite`` (one entry per parameter of ``parameters()``, which the estimator
    reports at its next decomposition step; no host sync here). FSDP2-sharded parameters
    contribute their rows' terms, summed over the shards (``sharding.sum_over_shards``).
    """

    def __init__(self, kl_clip: float, trust_region: TrustRegion, parameters: Callable[[], list[Tensor]],
                 sharding: Sharding, nonfinite: Tensor) -> None:
        self.kl_clip = kl_clip
        self.trust_region = trust_region
        self._parameters = parameters
        self._sharding = sharding
        self.nonfinite = nonfinite

    @record_function("kfac.kl_clip")
    def apply(self, directions: dict[Tensor, Tensor], groups: list[dict[str, Any]],
              state: dict[Tensor, dict[str, Any]]) -> dict[Tensor, Tensor]:
        if not directions:
            return directions
        lr_of = {p: self.trust_region.lr(group) for group in groups for p in group["params"]}
        zero = self.nonfinite.new_zeros((), dtype=next(iter(directions.values())).dtype)

        def term(param: Tensor) -> Tensor:
            if param not in directions or param.grad is None:
                return zero
            rows, grad = fsdp.local(directions[param]), fsdp.local(param.grad)
            return torch.vdot(rows.reshape(-1), grad.to(rows.dtype).reshape(-1)) * lr_of[param] ** 2

        # one per K-FAC parameter, in block order; 0 for those without a direction
        params = self._parameters()
        per_parameter = torch.stack([term(param) for param in params])
        if self._sharding.row_sharded is not None:  # one all-reduce of the terms over the shard group
            sharded = [fsdp.is_sharded(p) for p in params]
            summed = self._sharding.sum_over_shards(per_parameter.clone())
            per_parameter = torch.stack([summed[i] if s else per_parameter[i] for i, s in enumerate(sharded)])
        finite = torch.isfinite(per_parameter)
        self.nonfinite += ~finite
        kl_estimate = per_parameter.where(finite, 0.0).sum().abs()
        nu = (self.kl_clip / kl_estimate).sqrt().clamp(max=1.0)
        torch._foreach_mul_([fsdp.local(d) for d in directions.values()], nu)
        return directions


def step_length_for(options: KFACOptions, trust_region: TrustRegion, parameters: Callable[[], list[Tensor]],
                    sharding: Sharding, nonfinite: Tensor) -> StepLength:
    """The step length ``options`` ask for: ``UpdateConfig.grafting``'s graft (``KFACOptions``
    refuses it beside ``kl_clip``), else the KL clip, else none. Grafts are refused under FSDP2
    row sharding (``NotImplementedError``)."""
    update = options.update
    row_sharded = sharding.row_sharded is not None
    if update.grafting == "sgd":
        return SGDGraft(row_sharded)
    if update.grafting == "adam":
        return AdamGraft(update.adam_betas, update.adam_eps, row_sharded)
    if options.kl_clip is not None:
        return KLClip(options.kl_clip, trust_region, parameters, sharding, nonfinite)
    return NoClip()
