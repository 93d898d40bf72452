"""The step's length: what turns K-FAC's preconditioned directions into the directions SGD's update
applies (docs/design.md §4.1). One owner, chosen once at construction by :func:`step_length_for`
from the public settings: K-FAC's direction at SGD's first-order decrease, under a KL bound
(:class:`SGDDecrease`, the default ``UpdateConfig(trust_region="sgd")``), a KL clip (:class:`KLClip`, the other trust
regions), an SGD or Adam graft per tensor (``UpdateConfig(grafting=...)``, :class:`kfac_optim.update.grafting.SGDGraft`
/ ``AdamGraft``) or none (:class:`NoClip`, ``kl_clip=None``).

Owns: the :class:`StepLength` interface and the choice; ν, its sums (over shards: the strategy's) and its
count of non-finite directions (:func:`summed_terms`); the trust-region lr ``lr₀`` of each param group
(:class:`TrustRegion`, ``UpdateConfig.trust_region``) with its base lr and the zero-base-lr warning.
Must not know: the curvature or the blocks (it is handed the parameters in block order, the
distribution strategy and the counter the estimator reports), where tensors live, SGD's update, schedules.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor
from torch.profiler import record_function

from kfac_optim.diagnostics import warn_user
from kfac_optim.update.grafting import AdamGraft, SGDGraft

if TYPE_CHECKING:
    from kfac_optim.distributed.strategy import DistributionStrategy

__all__ = ["KLClip", "NoClip", "SGDDecrease", "StepLength", "TrustRegion", "step_length_for", "summed_terms"]

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
        """``lr₀`` of ``group``: "lr_squared" 1; "scheduled_lr" and "sgd" (the default, whose KL bound
        holds at the scheduled lr) its lr; "base_lr" its
        ``"kfac_base_lr"`` (a group loaded from a state dict of an earlier release gets its
        ``"initial_lr"``, set by ``torch.optim.lr_scheduler``, else its lr now)."""
        if self.rule == "lr_squared":
            return 1.0
        if self.rule in ("scheduled_lr", "sgd"):
            return group["lr"]
        if "kfac_base_lr" not in group:
            group["kfac_base_lr"] = _copy_lr(group.get("initial_lr", group["lr"]))
        return group["kfac_base_lr"]


class KLClip:
    """``kl_clip=c``: every direction scaled by ``ν = min(1, sqrt(c / |Σ lr₀² ⟨d, ∇p⟩|))`` in place.

    ``lr₀`` is the parameter's group's :meth:`TrustRegion.lr` (1 under
    ``trust_region="lr_squared"``), so the bound on the applied step ``lr·ν·d`` at the scheduled
    ``lr`` is ``c·(lr/lr₀)²`` (docs/design.md §4.1).

    The sum runs over the layers whose term is finite: a layer with a non-finite gradient has a
    non-finite direction (its preconditioner mixes all its entries) and is left out, so one bad
    entry cannot make every layer's update non-finite through ν. Such steps are counted on the
    device in ``nonfinite`` (one entry per parameter of ``parameters()``, which the estimator
    reports at its next decomposition step; no host sync here). Sharded parameters contribute
    their local rows' terms, summed over the shards (``DistributionStrategy.summed_over_shards``).
    """

    def __init__(self, kl_clip: float, trust_region: TrustRegion, parameters: Callable[[], list[Tensor]],
                 strategy: DistributionStrategy, nonfinite: Tensor) -> None:
        self.kl_clip = kl_clip
        self.trust_region = trust_region
        self._parameters = parameters
        self._strategy = strategy
        self.nonfinite = nonfinite

    terms = 1
    """How many sums :meth:`scale` reads (the columns of :meth:`term`)."""

    @record_function("kfac.kl_clip")
    def apply(self, directions: dict[Tensor, Tensor], groups: list[dict[str, Any]],
              state: dict[Tensor, dict[str, Any]]) -> dict[Tensor, Tensor]:
        if not directions:
            return directions
        lr_of: dict[Tensor, float | Tensor] = {}
        for group in groups:
            lr_of.update(dict.fromkeys(group["params"], self.trust_region.lr(group)))
        params = self._parameters()
        sums = summed_terms(directions, params, [lr_of[p] for p in params], self._strategy, self.nonfinite, self)
        torch._foreach_mul_([self._strategy.local(d) for d in directions.values()], self.scale(sums))
        return directions

    def products(self, direction: Tensor, grad: Tensor) -> list[Tensor]:
        """The inner products :meth:`term` reads, 0-dim each, of one parameter's flattened direction
        and gradient rows: ``⟨V, ∇⟩``."""
        return [torch.vdot(direction, grad)]

    def term(self, products: Tensor, lr: float | Tensor) -> Tensor:
        """The terms ``(R, terms)`` of R parameters from their :meth:`products` ``(R, k)`` and their
        :meth:`TrustRegion.lr`, the same for all R: the KL estimate ``lr² ⟨V, ∇⟩``."""
        return products * lr**2

    def scale(self, sums: Tensor) -> Tensor:
        """ν from the summed terms ``(terms,)``."""
        return (self.kl_clip / sums[0].abs()).sqrt().clamp(max=1.0)


class Terms(Protocol):
    """What :func:`summed_terms` sums: per parameter a few inner products, turned into ``terms`` terms
    at the parameter's trust-region lr (:class:`KLClip`, :class:`SGDDecrease`)."""

    terms: int

    def products(self, direction: Tensor, grad: Tensor) -> list[Tensor]: ...

    def term(self, products: Tensor, lr: float | Tensor) -> Tensor: ...


_RunKey = tuple[torch.dtype, float | Tensor] | None
"""What parameters must share to take :meth:`Terms.term` together: their products' dtype and their lr
(None: parameters without a direction or gradient, whose terms are 0)."""


def _same_run(a: _RunKey, b: _RunKey) -> bool:
    """Whether ``a`` and ``b`` give the same bits through :meth:`Terms.term`: both None, or the same
    dtype and the same multiplier (the same tensor, or Python numbers of the same type, value and
    sign: ``0.0`` and ``-0.0`` compare equal but differ)."""
    if a is None or b is None:
        return a is b
    (dtype_a, lr_a), (dtype_b, lr_b) = a, b
    if dtype_a != dtype_b:
        return False
    if isinstance(lr_a, Tensor) or isinstance(lr_b, Tensor):
        return lr_a is lr_b
    return type(lr_a) is type(lr_b) and lr_a == lr_b and math.copysign(1.0, lr_a) == math.copysign(1.0, lr_b)


def summed_terms(directions: dict[Tensor, Tensor], params: list[Tensor], lrs: list[float | Tensor],
                 strategy: DistributionStrategy, nonfinite: Tensor, rule: Terms) -> Tensor:
    """``Σ_p rule.term(products of p, lr of p)`` over the K-FAC parameters ``params`` (block order; ``lrs``
    their trust-region lrs) whose terms are finite: ``rule.products`` maps a parameter's flattened local
    direction rows and gradient rows (in the direction's dtype) to its inner products, ``rule.term``
    maps those of R parameters ``(R, k)`` to their ``(R, rule.terms)`` terms; a parameter without a
    direction or gradient contributes 0. Sharded parameters' terms are summed over the shards first
    (``strategy``). A parameter with a non-finite term is left out and counted in ``nonfinite`` (one
    entry per parameter, on the device: a non-finite gradient makes its layer's whole direction
    non-finite). Returns ``(rule.terms,)``.

    Consecutive parameters with the same lr and products' dtype (:func:`_same_run`) take ``rule.term``
    together (one elementwise op per term for the whole run, usually every parameter): the same bits
    as one ``rule.term`` per parameter, as elementwise products by the same scalar are; a tensor lr
    first promotes the products as a 0-dim product of two tensors would."""
    zero = nonfinite.new_zeros(rule.terms, dtype=next(iter(directions.values())).dtype)
    runs: list[tuple[_RunKey, list[list[Tensor]]]] = []  # in parameter order: (key, each parameter's products)
    for param, lr in zip(params, lrs, strict=True):
        key: _RunKey = None
        products: list[Tensor] = []
        if param in directions and param.grad is not None:
            rows, grad = strategy.local(directions[param]), strategy.local(param.grad)
            key, products = (rows.dtype, lr), rule.products(rows.reshape(-1), grad.to(rows.dtype).reshape(-1))
        if runs and _same_run(runs[-1][0], key):
            runs[-1][1].append(products)
        else:
            runs.append((key, [products]))
    blocks = []
    for key, run in runs:
        if key is None:
            blocks.append(zero.repeat(len(run), 1))
            continue
        stacked = torch.stack([product for products in run for product in products]).reshape(len(run), -1)
        lr = key[1]
        if isinstance(lr, Tensor):
            stacked = stacked.to(torch.promote_types(stacked.dtype, lr.dtype))
        blocks.append(rule.term(stacked, lr))
    per_parameter = strategy.summed_over_shards(blocks[0] if len(blocks) == 1 else torch.cat(blocks), params)
    finite = torch.isfinite(per_parameter).all(dim=1)
    nonfinite += ~finite
    return per_parameter.where(finite[:, None], 0.0).sum(dim=0)


class SGDDecrease(KLClip):
    """``trust_region="sgd"`` (the default): K-FAC's directions at the length where they promise SGD's
    first-order decrease of the loss, the step's KL estimate bounded by ``kl_clip`` whatever the lr.

    With ``lr_g`` each param group's scheduled lr (:meth:`TrustRegion.lr`) and the sums over the
    K-FAC parameters ``p`` that have a direction::

        ν = Σ lr_g ‖∇p‖² / Σ lr_g ⟨V_p, ∇p⟩              ⟨lr·ν·V, ∇⟩ = ⟨lr·∇, ∇⟩: SGD's first-order decrease
        ν ← min(ν, sqrt(kl_clip / |Σ lr_g² ⟨V_p, ∇p⟩|))  the applied step's KL estimate at most ``kl_clip``

    and every direction is scaled by ν in place (1 where every lr is 0). One ν for all K-FAC
    parameters, so K-FAC's proportions across layers are kept. The lr scales the step as it scales
    SGD's until the step's KL estimate reaches ``kl_clip``; from there the step stays put, so a
    mistyped lr is bounded. Every term is homogeneous in the loss's scale, so a summed loss at
    ``lr/N`` takes the step of the mean loss at ``lr`` when the factors keep their units
    (``loss_reduction="sum"``). Why this length: on a quadratic whose curvature K-FAC's factors
    hold (eigenvalues ``h``, gradient components ``g``), ``V = g/(h + λ)``, and at equal first-order
    decrease the curvature term of ``ν·V`` is at most SGD's (Cauchy–Schwarz; equal as λ → ∞, where
    ``ν·V → ∇``), and along the largest eigenvalue ``ν·V`` is no longer than ``∇`` (ν, a weighted
    harmonic mean of ``h + λ``, is at most its largest): stable where SGD's lr is
    (docs/design.md §4.1). Non-finite terms, shards and the constructor as :class:`KLClip`,
    whose ν is capped at 1 where this one's is capped at SGD's decrease.
    """

    terms = 3

    def products(self, direction: Tensor, grad: Tensor) -> list[Tensor]:
        """``‖∇‖²`` and ``⟨V, ∇⟩``."""
        return [torch.vdot(grad, grad), torch.vdot(direction, grad)]

    def term(self, products: Tensor, lr: float | Tensor) -> Tensor:
        """SGD's decrease ``lr ‖∇‖²``, K-FAC's ``lr ⟨V, ∇⟩`` and the KL estimate ``lr² ⟨V, ∇⟩``."""
        squared, inner = products.unbind(1)
        return torch.stack([squared * lr, inner * lr, inner * lr**2], dim=1)

    def scale(self, sums: Tensor) -> Tensor:
        sgd, kfac, kl_estimate = sums
        nu = (sgd / kfac).where(kfac > 0, 1.0)
        return torch.minimum(nu, (self.kl_clip / kl_estimate.abs()).sqrt())


class UpdateSettings(Protocol):
    """The fields of ``kfac_optim.config.UpdateConfig`` that choose the step length."""

    trust_region: str
    grafting: str | None
    adam_betas: tuple[float, float]
    adam_eps: float


def step_length_for(update: UpdateSettings, kl_clip: float | None, trust_region: TrustRegion,
                    parameters: Callable[[], list[Tensor]], strategy: DistributionStrategy,
                    nonfinite: Tensor) -> StepLength:
    """The step length ``update`` and ``kl_clip`` ask for: ``update.grafting``'s graft (``KFACOptions``
    refuses it beside ``kl_clip``), else none at ``kl_clip=None``, else SGD's decrease under the KL bound
    (``trust_region="sgd"``) or the KL clip. Grafts are refused (``NotImplementedError``) where a rank
    holds only part of a parameter (``strategy.whole_tensors``: its norm would need the others' sums)."""
    if update.grafting is not None and not strategy.whole_tensors:
        raise NotImplementedError(
            "UpdateConfig.grafting is not supported where a rank holds only part of a parameter (FSDP2-sharded "
            "parameters)"
        )
    if update.grafting == "sgd":
        return SGDGraft()
    if update.grafting == "adam":
        return AdamGraft(update.adam_betas, update.adam_eps)
    if kl_clip is None:
        return NoClip()
    if update.trust_region == "sgd":
        return SGDDecrease(kl_clip, trust_region, parameters, strategy, nonfinite)
    return KLClip(kl_clip, trust_region, parameters, strategy, nonfinite)
