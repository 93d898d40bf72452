"""SGD's update on K-FAC's directions: the last move of ``KFAC.step()``.

Owns :func:`sgd_update`: per param group, ``torch.optim.SGD``'s update (through torch's own
``sgd`` functional, so the SGD path is SGD bit for bit) on each parameter's direction, the
decoupled weight decay of ``UpdateConfig``, and ``p ← p − lr·d`` for the parameters that took
Adam's step (``update.adam.AdamOutsideKFAC``).
Must not know: where the directions come from (curvature, step length, grafts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.sgd import sgd
from torch.profiler import record_function


@record_function("kfac.sgd")
def sgd_update(groups: list[dict[str, Any]], state: dict[Tensor, dict[str, Any]], directions: dict[Tensor, Tensor],
               adam: dict[Tensor, Tensor], decoupled: bool) -> None:
    """``torch.optim.SGD``'s update, per group of ``groups``, on the (possibly preconditioned)
    ``directions`` (a parameter without one: its gradient), momentum buffers in ``state[p]``; with
    ``decoupled`` (``UpdateConfig.decoupled_weight_decay``) the group's decay first as
    ``p ← p·(1 − lr·wd)``. The parameters in ``adam`` (Adam's steps) take ``p ← p − lr·d`` alone."""
    for group in groups:
        params: list[Tensor] = []
        grads: list[Tensor] = []
        momentum_buffers: list[Tensor | None] = []
        has_sparse_grad = False
        stepped = [p for p in group["params"] if p in adam]
        if stepped:
            if decoupled and group["weight_decay"] != 0:
                torch._foreach_mul_(stepped, 1 - group["lr"] * group["weight_decay"])
            updates = [adam[p] for p in stepped]  # Adam's fresh steps: scaled in place
            if isinstance(group["lr"], Tensor):
                torch._foreach_mul_(updates, group["lr"])
                torch._foreach_sub_(stepped, updates)
            else:
                torch._foreach_add_(stepped, updates, alpha=-group["lr"])
        for p in group["params"]:
            if p.grad is None or p in adam:
                continue
            params.append(p)
            grads.append(directions.get(p, p.grad))
            has_sparse_grad |= p.grad.is_sparse
            if group["momentum"] != 0:
                momentum_buffers.append(state[p].get("momentum_buffer"))
        weight_decay = group["weight_decay"]
        if decoupled and weight_decay != 0 and params:
            torch._foreach_mul_(params, 1 - group["lr"] * weight_decay)
            weight_decay = 0.0
        sgd(
            params,
            grads,
            momentum_buffers,
            weight_decay=weight_decay,
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            has_sparse_grad=has_sparse_grad,
            foreach=group["foreach"],
        )
        if group["momentum"] != 0:
            for p, buffer in zip(params, momentum_buffers, strict=True):
                state[p]["momentum_buffer"] = buffer
