"""Grafting (Agarwal et al. 2020, "Disentangling adaptive gradient methods from learning rates";
Distributed Shampoo's default): K-FAC's direction with the step length of a simple optimizer.

Owns: the per-parameter-tensor grafts of ``UpdateConfig(grafting=...)`` (:class:`SGDGraft`,
:class:`AdamGraft`, two of ``kfac_optim.update.step_length``'s step lengths) and the graft
optimizer's state (Adam's moments, in the optimizer's ``state[p]`` so ``state_dict()`` carries
them; Adam's step itself is ``kfac_optim.update.adam``'s).
Must not know: the curvature, the blocks, the KL clip, SGD's update (``update.sgd`` applies the result).

For every parameter ``p`` with a gradient ``∇p`` (docs/design.md §4.1)::

    "sgd":   s = ∇p                                        M = V
    "adam":  m ← β1·m + (1−β1)·∇p,  v ← β2·v + (1−β2)·∇p²   M ← β1·M + (1−β1)·V
             s = (m / (1−β1ᵗ)) / (sqrt(v / (1−β2ᵗ)) + ε)
    d = M · ‖s‖ / ‖M‖   for K-FAC parameters (V their preconditioned direction),
    d = s               for every other parameter,

and SGD's update then runs on ``d`` (under "adam" with momentum 0: Adam's ``m`` and the average
``M`` are the momentum). Norms are per tensor, computed on the device (no host sync).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from kfac_optim.update.adam import adam_step, refuse_sparse

__all__ = ["AdamGraft", "SGDGraft"]

logger = logging.getLogger(__name__)

_TINY = 1e-30
"""Floor of ``‖M‖``: a zero direction stays zero instead of becoming nan."""


class SGDGraft:
    """``UpdateConfig(grafting="sgd")``: ``d = V·‖∇p‖/‖V‖`` per K-FAC parameter tensor; every other
    parameter keeps its gradient (SGD's path). A :class:`kfac_optim.update.step_length.StepLength`."""

    def apply(self, directions: dict[Tensor, Tensor], groups: list[dict[str, Any]],
              state: dict[Tensor, dict[str, Any]]) -> dict[Tensor, Tensor]:
        """The grafted direction of every parameter of ``groups`` with a gradient and a K-FAC
        direction ``V`` in ``directions`` (scaled in place), by parameter."""
        grafted: dict[Tensor, Tensor] = {}
        for p in _with_gradients(groups):
            direction = directions.get(p)
            if direction is not None:
                grafted[p] = direction.mul_(_norm_ratio(p.grad, direction))
        return grafted


class AdamGraft:
    """``UpdateConfig(grafting="adam")``: ``d = M·‖s‖/‖M‖`` per K-FAC parameter tensor, ``d = s`` for
    every other parameter with a gradient (the module docstring); Adam's moments and the average
    ``M`` in ``state[p]``. A :class:`kfac_optim.update.step_length.StepLength`."""

    def __init__(self, betas: tuple[float, float], eps: float) -> None:
        self.betas = betas
        self.eps = eps

    def apply(self, directions: dict[Tensor, Tensor], groups: list[dict[str, Any]],
              state: dict[Tensor, dict[str, Any]]) -> dict[Tensor, Tensor]:
        """The grafted direction ``d`` of every parameter of ``groups`` with a gradient, by parameter
        (``directions``: K-FAC's ``V`` by parameter, the parameters it preconditions)."""
        params = list(_with_gradients(groups))
        refuse_sparse(params, "UpdateConfig.grafting='adam'")
        grafted: dict[Tensor, Tensor] = {}
        for p in params:
            direction = directions.get(p)
            step = adam_step(p.grad, state[p], self.betas, self.eps)
            if direction is None:
                grafted[p] = step
                continue
            average = state[p].get("graft_direction_avg")
            if average is None:
                average = state[p]["graft_direction_avg"] = torch.zeros_like(direction)
            average.lerp_(direction, 1 - self.betas[0])
            grafted[p] = average * _norm_ratio(step, average)
        return grafted


def _with_gradients(groups: list[dict[str, Any]]) -> Iterator[Tensor]:
    """The parameters of ``groups`` that have a gradient, in group order."""
    return (p for group in groups for p in group["params"] if p.grad is not None)


def _norm_ratio(reference: Tensor, direction: Tensor) -> Tensor:
    """``‖reference‖ / ‖direction‖`` as a 0-dim tensor on the device (``‖direction‖`` floored)."""
    return (torch.linalg.vector_norm(reference).to(direction.dtype)
            / torch.linalg.vector_norm(direction).clamp(min=_TINY))
