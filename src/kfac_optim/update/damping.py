"""The damping λ of each step: a schedule, or adapted by Levenberg–Marquardt (docs/design.md §4.2).

Owns: :class:`AdaptiveDamping` (the setting, validated), the rule behind each kind of ``damping``
(:func:`damping_rule`: :class:`ScheduledDamping` for a float or a callable, :class:`LevenbergMarquardt`
for an ``AdaptiveDamping``), the adaptive rule's state (λ and the last reduction ratio, saved in
checkpoints) and its quadratic model.
Must not know: param groups' SGD settings, the KL clip, how blocks precondition (the optimizer
hands it the parameters, the closure and the blocks at the points below).

**Levenberg–Marquardt** (Martens & Grosse 2015 §6.5). Every ``every`` steps (``T₁``; the steps
``k`` with ``k % every == 0``), with ``θ`` the parameters before the step, ``δ`` the change the
step applied to them, ``h`` the closure's loss on the step's batch and ``∇h`` the gradients its
backward left::

    M(δ) − M(0) = ⟨∇h, δ⟩ + ½ Σ_blocks ⟨D, G D A⟩        (D: a block's joint change [δW | δb])
    ρ = (h(θ + δ) − h(θ)) / (M(δ) − M(0))
    λ ← max(ω·λ, minimum)  if ρ > 3/4;   λ ← min(λ/ω, maximum)  if ρ < 1/4 or ρ is not finite

``h(θ + δ)`` is one more call of the closure, under ``torch.no_grad()``, after the update. The
model's curvature is each block's undamped running ``G ⊗ A`` (why: docs/design.md §4.2, "Which
curvature"); parameters outside the blocks contribute ``⟨∇h, δ⟩`` only.
"""

from __future__ import annotations

import logging
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kfac_optim.layers import KroneckerBlock
from kfac_optim.schedule.milestones import resolve

__all__ = ["AdaptiveDamping", "DampingRule", "LevenbergMarquardt", "ScheduledDamping", "damping_rule",
           "kronecker_quadratic"]

logger = logging.getLogger(__name__)

SHRINK_ABOVE = 0.75
"""ρ above which the model is trusted more (λ shrinks)."""
GROW_BELOW = 0.25
"""ρ below which it is trusted less (λ grows)."""


def check_damping(value: float) -> float:
    if not 0 < value < math.inf:
        raise ValueError(f"damping must be a finite number > 0, got {value}")
    return value


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
        raise ValueError(f"AdaptiveDamping.{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class AdaptiveDamping:
    """``damping=AdaptiveDamping(...)``: λ adapted by Levenberg–Marquardt (module docstring).

    ``initial``: λ at step 0. ``every``: ``T₁``, adapt on the steps ``k % every == 0`` (int >= 1).
    ``omega``: ``ω`` in (0, 1), the factor λ is multiplied or divided by; None:
    ``(19/20)**every``, Martens & Grosse's choice. ``minimum``, ``maximum``: the bounds of λ.
    Needs ``step(closure)`` (docs/api.md "Adaptive damping").
    """

    initial: float = 0.1
    every: int = 5
    omega: float | None = None
    minimum: float = 1e-6
    maximum: float = 1e3
    factor: float = field(init=False, repr=False)
    """``ω`` as used: ``omega`` or its default."""

    def __post_init__(self) -> None:
        for name in ("initial", "minimum", "maximum"):
            _check_positive(name, getattr(self, name))
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"AdaptiveDamping.every must be an int >= 1, got {self.every!r}")
        if self.omega is not None and (isinstance(self.omega, bool) or not isinstance(self.omega, numbers.Real)
                                       or not 0 < self.omega < 1):
            raise ValueError(f"AdaptiveDamping.omega must be a number in (0, 1) or None, got {self.omega!r}")
        if not self.minimum <= self.initial <= self.maximum:
            raise ValueError(
                f"AdaptiveDamping needs minimum <= initial <= maximum, got {self.minimum}, {self.initial}, "
                f"{self.maximum}"
            )
        object.__setattr__(self, "factor", float(self.omega) if self.omega is not None else (19 / 20) ** self.every)


Closure = Callable[[], Any]


class DampingRule(ABC):
    """λ at each step, and what the optimizer does for it around the update (by default nothing)."""

    @abstractmethod
    def at(self, step: int) -> float:
        """λ at ``step``."""

    def begin(self, step: int, closure: Closure | None, loss: Any, params: Sequence[Tensor],
              maximize: bool) -> Measurement | None:
        """Called by ``step()`` before anything changes; a :class:`Measurement` to finish after
        the update, or None (no measurement at this step)."""
        return None

    @property
    def reduction_ratio(self) -> float | None:
        """The last measured ρ (None: none measured, or not an adaptive rule)."""
        return None

    def state_dict(self) -> dict[str, float | None] | None:
        """``AdaptiveDamping``'s λ and last ρ, ``{"damping", "rho"}``; None: a constant or scheduled λ."""
        return None

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming the field if ``state`` is not None or a :meth:`state_dict` of an
        adaptive rule (checked whatever the rule, as every rule reads any)."""
        if state is None:
            return
        if not isinstance(state, dict) or set(state) != {"damping", "rho"}:
            raise ValueError("expected None or a dict with 'damping' and 'rho'")
        damping, rho = state["damping"], state["rho"]
        if isinstance(damping, bool) or not isinstance(damping, numbers.Real) or not 0 < damping < math.inf:
            raise ValueError(f"'damping' must be a finite number > 0, got {damping!r}")
        if rho is not None and (isinstance(rho, bool) or not isinstance(rho, numbers.Real)):
            raise ValueError(f"'rho' must be a number or None, got {rho!r}")

    def load_state_dict(self, state: dict[str, float | None] | None) -> None:
        if state is not None:
            logger.warning("K-FAC checkpoint holds adaptive damping state (%s), but this optimizer's damping is not "
                           "an AdaptiveDamping: ignored", state)


class ScheduledDamping(DampingRule):
    """``damping`` as a float > 0 or a callable ``step -> float``."""

    def __init__(self, damping: float | Callable[[int], float]) -> None:
        self.damping = damping

    def at(self, step: int) -> float:
        return check_damping(resolve(self.damping, step))


@dataclass
class Measurement:
    """What one Levenberg–Marquardt step keeps from before the update: ``h(θ)`` and ``θ``."""

    rule: LevenbergMarquardt
    loss: Tensor
    params: list[Tensor]
    before: list[Tensor]
    closure: Closure

    def finish(self, blocks: Iterable[KroneckerBlock]) -> None:
        """After the update (the blocks' factors settled): ρ, then λ (:meth:`LevenbergMarquardt.finish`)."""
        self.rule.finish(self, blocks)


class LevenbergMarquardt(DampingRule):
    """λ adapted from the reduction ratio ρ of the quadratic model (module docstring)."""

    def __init__(self, config: AdaptiveDamping) -> None:
        self.config = config
        self.damping = config.initial
        self.rho: float | None = None

    def at(self, step: int) -> float:
        return self.damping

    @property
    def reduction_ratio(self) -> float | None:
        return self.rho

    def begin(self, step: int, closure: Closure | None, loss: Any, params: Sequence[Tensor],
              maximize: bool) -> Measurement | None:
        """Raises ``ValueError`` (before any state changes) without a closure or under ``maximize``."""
        if closure is None:
            raise ValueError(
                "damping=AdaptiveDamping(...) needs the loss on the step's batch: call optimizer.step(closure) "
                "with a closure that runs the forward pass, calls loss.backward() only when torch.is_grad_enabled(), "
                "and returns the loss (docs/api.md 'Adaptive damping')"
            )
        if maximize:
            raise ValueError("damping=AdaptiveDamping(...) minimizes the closure's loss: "
                             "maximize=True is not supported")
        if step % self.config.every:
            return None
        if not isinstance(loss, Tensor | numbers.Real):
            raise TypeError(f"AdaptiveDamping: the closure must return the loss, got {type(loss).__name__}")
        params = [p for p in params if p.grad is not None]
        return Measurement(self, torch.as_tensor(loss).detach().clone(), params, [p.detach().clone() for p in params],
                           closure)

    def finish(self, measurement: Measurement, blocks: Iterable[KroneckerBlock]) -> None:
        """After the update: ρ from the applied change and one more closure call, then λ."""
        changes = {p: p.detach() - before for p, before in zip(measurement.params, measurement.before, strict=True)}
        linear = sum(torch.vdot(_dense(p.grad).reshape(-1), d.to(p.grad.dtype).reshape(-1)) for p, d in changes.items())
        quadratic = sum(kronecker_quadratic(block, changes) for block in blocks)
        model_change = linear + 0.5 * quadratic  # a tensor on the parameters' device (0 without any change)
        with torch.no_grad():
            try:
                after = measurement.closure()
            except RuntimeError as error:
                if "does not require grad" not in str(error):
                    raise
                raise RuntimeError(
                    "AdaptiveDamping calls the closure once more under torch.no_grad() after the update, "
                    "to measure the loss there: guard its backward with `if torch.is_grad_enabled(): loss.backward()`"
                ) from error
        rho = float((torch.as_tensor(after).detach() - measurement.loss) / model_change)  # one host sync per T₁ steps
        self.adapt(rho)

    def adapt(self, rho: float) -> None:
        """λ from ρ: shrink above 3/4, grow below 1/4 or when ρ is not finite, within the bounds."""
        config = self.config
        self.rho = rho
        if not math.isfinite(rho) or rho < GROW_BELOW:  # not finite: a model change of 0, or a non-finite loss
            self.damping = min(self.damping / config.factor, config.maximum)
        elif rho > SHRINK_ABOVE:
            self.damping = max(self.damping * config.factor, config.minimum)
        logger.debug("AdaptiveDamping: rho %.4g, damping %.4g", rho, self.damping)

    def state_dict(self) -> dict[str, float | None]:
        return {"damping": self.damping, "rho": self.rho}

    def load_state_dict(self, state: dict[str, float | None] | None) -> None:
        if state is None:
            logger.warning("K-FAC checkpoint holds no adaptive damping state: damping restarts at %g",
                           self.config.initial)
            self.damping, self.rho = self.config.initial, None
            return
        self.damping, self.rho = float(state["damping"]), state["rho"]


def damping_rule(damping: float | Callable[[int], float] | AdaptiveDamping, distributed: bool = False) -> DampingRule:
    """The rule of a ``damping`` setting; ``distributed``: several ranks, or FSDP2-sharded layers.

    Raises:
        NotImplementedError: ``AdaptiveDamping`` when ``distributed`` (its ρ would need the losses
            and the curvature term summed over the ranks; not built yet).
    """
    if not isinstance(damping, AdaptiveDamping):
        return ScheduledDamping(damping)
    if distributed:
        raise NotImplementedError(
            "damping=AdaptiveDamping(...) is not supported with several ranks or FSDP2-sharded layers yet: use a "
            "constant damping or a schedule"
        )
    return LevenbergMarquardt(damping)


def kronecker_quadratic(block: KroneckerBlock, changes: dict[Tensor, Tensor]) -> Tensor | float:
    """``⟨D, G D A⟩ = vec(D)ᵀ (G ⊗ A) vec(D)`` for the block's joint change ``D`` (0. without one).

    ``changes``: per parameter, its change, shaped as the parameter. ``G``, ``A``: the running
    factors (dense ``(n, n)``, grouped ``(k, n, n)`` or diagonal ``(n,)``), undamped.
    """
    weight = changes.get(block.weight)
    if weight is None:
        return 0.0
    bias = None
    if block.bias is not None:
        bias = changes.get(block.bias, torch.zeros_like(block.bias))
    joint = block.joint_gradient(weight, bias).to(block.A.running.dtype)
    right = joint * block.A.running if block.A.diagonal else joint @ block.A.running
    left = block.G.running.unsqueeze(-1) * right if block.G.diagonal else block.G.running @ right
    return torch.vdot(joint.reshape(-1), left.reshape(-1))


def _dense(grad: Tensor) -> Tensor:
    """``grad``, a sparse one (``nn.Embedding(sparse=True)``) made dense."""
    return grad.to_dense() if grad.is_sparse else grad
