"""Adam's step where K-FAC gives no direction, and the step both of Adam's users share.

Owns: Adam's bias-corrected step and its state in the optimizer's ``state[p]`` (:func:`adam_step`,
also the graft's: ``kfac_optim.update.grafting.AdamGraft``); Adam's update for the parameters that
a method of Adam's scale (``Method.outside_kfac``: ``"eigen_adam"``) leaves outside K-FAC
(:class:`AdamOutsideKFAC`) and the checks made before any hook is registered
(:func:`outside_kfac_for`).
Must not know: the curvature, the blocks, the step length, SGD's update (``update.sgd`` applies
``p ← p − lr·d``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from kfac_optim.methods import Method

__all__ = ["AdamOutsideKFAC", "adam_step", "outside_kfac_for", "refuse_sparse"]

logger = logging.getLogger(__name__)


def adam_step(grad: Tensor, state: dict[str, Any], betas: tuple[float, float], eps: float) -> Tensor:
    """Adam's bias-corrected ``m̂ / (sqrt(v̂) + ε)`` for ``grad``, its moments and step count kept in
    ``state`` (a parameter's optimizer state: ``"step"``, ``"graft_exp_avg"``, ``"graft_exp_avg_sq"``)."""
    beta1, beta2 = betas
    if "step" not in state:  # "step": the key load_state_dict leaves in its dtype (at least float32)
        state["step"] = torch.zeros((), dtype=torch.promote_types(grad.dtype, torch.float32), device=grad.device)
        state["graft_exp_avg"] = torch.zeros_like(grad)
        state["graft_exp_avg_sq"] = torch.zeros_like(grad)
    count = state["step"].add_(1)
    mean = state["graft_exp_avg"].lerp_(grad, 1 - beta1)
    square = state["graft_exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    scale1 = 1 - torch.pow(beta1, count)
    scale2 = 1 - torch.pow(beta2, count)
    return (mean / scale1) / ((square / scale2).sqrt_().add_(eps))


def refuse_sparse(params: Iterable[Tensor], what: str) -> None:
    """``RuntimeError`` naming ``what`` if a parameter's gradient is sparse (Adam's moments are dense)."""
    sparse = next((p for p in params if p.grad is not None and p.grad.is_sparse), None)
    if sparse is not None:  # checked before any state changes
        raise RuntimeError(
            f"{what} needs dense gradients; a parameter of shape {tuple(sparse.shape)} has a "
            "sparse one (nn.Embedding(sparse=True)): use a dense embedding"
        )


class AdamOutsideKFAC:
    """``method="eigen_adam"``: the parameters without a K-FAC direction (LayerNorm gains, a position
    embedding left to SGD, a layer of a kind without a block) follow ``torch.optim.Adam`` with
    ``betas = (the group's momentum, beta2)`` and ``eps`` (the method's), instead of SGD's update at
    Adam's lr. The K-FAC parameters keep SGD's momentum on their direction, their first moment.

    Per parameter ``p`` with a gradient and no K-FAC direction::

        g = ±∇p (− under maximize) + weight_decay·p (coupled decay, as Adam's)
        d = m̂ / (sqrt(v̂) + ε)            (:func:`adam_step`; moments in ``state[p]``)

    and ``KFAC`` then applies ``p ← p − lr·d`` with no SGD momentum, dampening, decay or maximize on
    top (:attr:`stepped`), so ``p`` moves exactly as under ``torch.optim.Adam(lr, betas, eps,
    weight_decay)`` (``UpdateConfig.decoupled_weight_decay``: as ``AdamW``'s decay).
    """

    def __init__(self, method: str, beta2: float, eps: float, decoupled_weight_decay: bool,
                 beta1: float | None = None) -> None:
        self.method = method
        self.beta2 = beta2
        self.eps = eps
        self.decoupled = decoupled_weight_decay
        self.beta1 = beta1
        """The method's own β₁ (``Method.first_moment``); None: the group's momentum."""

    def describe(self) -> str:
        """The line ``KFAC.describe()`` adds: which parameters take Adam's update, and its settings."""
        beta1 = "the group's momentum" if self.beta1 is None else str(self.beta1)
        return (f"method {self.method}: the parameters without a K-FAC direction (the rows on the SGD path above, "
                f"and a block's before its first decomposition) take torch.optim.Adam's update with betas=({beta1}, "
                f"{self.beta2}), eps={self.eps}")

    def directions(self, groups: list[dict[str, Any]], state: dict[Tensor, dict[str, Any]],
                   preconditioned: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """Adam's direction ``d`` of every parameter of ``groups`` with a gradient and not in
        ``preconditioned`` (K-FAC's directions), by parameter."""
        refuse_sparse((p for group in groups for p in group["params"] if p not in preconditioned),
                       f"method={self.method!r} (Adam for the parameters outside K-FAC)")
        steps: dict[Tensor, Tensor] = {}
        for group in groups:
            betas = (group["momentum"] if self.beta1 is None else self.beta1, self.beta2)
            for p in group["params"]:
                if p.grad is None or p in preconditioned:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                if group["weight_decay"] != 0 and not self.decoupled:
                    grad = grad.add(p, alpha=group["weight_decay"])
                steps[p] = adam_step(grad, state[p], betas, self.eps)
        return steps


def outside_kfac_for(method: Method, grafting: str | None, decoupled_weight_decay: bool, groups: list[dict[str, Any]],
                     model: nn.Module, trainable: set[Tensor]) -> AdamOutsideKFAC | None:
    """Adam's step for the parameters without a K-FAC direction when ``method`` asks for it
    (``Method.outside_kfac``) and ``grafting`` (``UpdateConfig.grafting``) is not Adam's already; None: SGD's update.
    Checks, before any hook is registered, what Adam needs: ``grafting="adam"`` no SGD momentum in ``groups``,
    and either dense gradients for the parameters in ``trainable`` (``ValueError`` naming the module);
    a method that keeps its own first moment (``Method.first_moment``) no SGD momentum either."""
    beta1 = method.first_moment()
    if beta1 is not None and any(group["momentum"] != 0 for group in groups):
        raise ValueError(
            f"{method!r} keeps Adam's first moment itself (beta1={beta1}): set momentum=0 (and nesterov=False) in "
            "every param group, or beta1=None to use SGD's momentum on its directions"
        )
    if grafting == "adam":
        if any(group["momentum"] != 0 for group in groups):
            raise ValueError(
                "UpdateConfig.grafting='adam' carries its own momentum (Adam's first moment): set momentum=0 "
                "(and nesterov=False) in every param group"
            )
        _check_dense_gradients(model, trainable, "UpdateConfig.grafting='adam'")
        return None
    adam = method.outside_kfac()
    if adam is None:
        return None
    _check_dense_gradients(model, trainable, f"method={method.name!r} (Adam's step for the parameters outside K-FAC)")
    return AdamOutsideKFAC(method.name, *adam, decoupled_weight_decay, beta1)


def _check_dense_gradients(model: nn.Module, trainable: set[Tensor], what: str) -> None:
    """``ValueError`` naming ``what`` and the module when a module with ``sparse=True`` holds a
    parameter in ``trainable`` (Adam's moments are dense)."""
    sparse = [name for name, module in model.named_modules()
              if getattr(module, "sparse", False) is True and any(p in trainable for p in module.parameters(False))]
    if sparse:
        raise ValueError(f"{what} needs dense gradients: module {sparse[0]!r} has sparse=True")
