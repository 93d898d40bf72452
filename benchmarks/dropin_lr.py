"""The drop-in ``KFAC(model, lr)`` against ``torch.optim.SGD(lr)`` at SGD's lrs, one suspect at a time.

Usage: ``python -m benchmarks.dropin_lr [--variants ...] [--momenta 0 0.9] [--steps 20] [--seeds 2]``.

Three tiny models on synthetic teacher data (an MLP regression, a 2-layer ViT on 4x4 patches, a
2-conv convnet; batch 64): each variant trains ``--steps`` steps from the same seeds on the same
batches at every lr of the grid 0.01/0.03/0.1/0.3 and reports the mean held-out loss over the seeds.
The variants change one thing of the drop-in each (the trust region, the step's length rule, the
KL bound, the damping, the intervals; the length rules the library does not ship, SGD's Euclidean
length, per-layer lengths and K-FAC's own step floored at SGD's decrease, are written here as
:class:`AlternativeLength`);
``--ratios`` also prints ``‖ν·V‖/‖∇‖`` of the first 10 steps (the applied direction's length
against SGD's). The figures:
benchmarks/RESULTS.md "The drop-in at SGD's lr: each suspect measured alone".
"""

from __future__ import annotations

import argparse
import logging
import unittest.mock
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kfac_optim.optimizer
from kfac_optim import KFAC, UpdateConfig

LRS = (0.01, 0.03, 0.1, 0.3)
Batch = tuple[torch.Tensor, torch.Tensor]


class _PatchViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch, self.pos = nn.Linear(16, 32), nn.Parameter(torch.zeros(1, 16, 32))
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder, self.norm, self.head = nn.TransformerEncoder(layer, 2), nn.LayerNorm(32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, 1, 16, 16)
        patches = x.unfold(2, 4, 4).unfold(3, 4, 4).reshape(x.shape[0], 16, 16)
        return self.head(self.norm(self.encoder(self.patch(patches) + self.pos)).mean(dim=1))


def _regression(generator: torch.Generator) -> Batch:
    x = torch.randn(64, 8, generator=generator)
    return x, x @ (torch.randn(8, 1, generator=torch.Generator().manual_seed(123)) / 2)


def _images(generator: torch.Generator) -> Batch:
    templates = torch.randn(10, 1, 16, 16, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, 10, (64,), generator=generator)
    return templates[y] + 2 * torch.randn(64, 1, 16, 16, generator=generator), y


TASKS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], Batch], Callable[..., torch.Tensor]]] = {
    "regression": (lambda: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)),
                   _regression, F.mse_loss),
    "vit": (_PatchViT, _images, F.cross_entropy),
    "convnet": (lambda: nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                      nn.Linear(256, 10)),
                _images, F.cross_entropy),
}
class AlternativeLength:
    """A length rule measured against the default's (``kfac_optim.update.step_length.SGDDecrease``), under the
    same KL bound ``Σ lr²ν²⟨V_p, ∇p⟩ ≤ kl_clip``: ``"euclidean"``, ``ν = sqrt(Σ‖∇p‖² / Σ‖V_p‖²)`` (SGD's
    Euclidean length); ``"layer"``, each parameter's ``V_p`` at ``‖∇p‖`` (per-layer lengths), then one ν
    for the bound; ``"floor"``, ``ν = max(1, Σ‖∇p‖² / Σ⟨V_p, ∇p⟩)`` (K-FAC's own step ``lr·V``,
    lengthened to SGD's first-order decrease where it promises less). One param group, one process,
    finite gradients (a ``kfac_optim.update.step_length.StepLength``)."""

    def __init__(self, kl_clip: float, rule: str) -> None:
        self.kl_clip, self.rule = kl_clip, rule

    def apply(self, directions: dict[torch.Tensor, torch.Tensor], groups: list[dict[str, Any]],
              state: dict[torch.Tensor, dict[str, Any]]) -> dict[torch.Tensor, torch.Tensor]:
        pairs = [(d, p.grad) for p, d in directions.items() if p.grad is not None]
        if not pairs:
            return directions
        if self.rule == "layer":
            for d, g in pairs:
                d.mul_((g.norm() / d.norm()).nan_to_num(1.0, 1.0, 1.0))
        gg, vg, vv = (sum((a * b).sum() for a, b in products) for products in
                      ([(g, g) for _, g in pairs], [(d, g) for d, g in pairs], [(d, d) for d, _ in pairs]))
        nu = {"euclidean": (gg / vv).sqrt(), "layer": torch.ones_like(gg), "floor": (gg / vg).clamp(min=1.0)}[self.rule]
        nu = torch.minimum(nu, (self.kl_clip / (float(groups[0]["lr"]) ** 2 * vg.abs())).sqrt())
        for d in directions.values():
            d.mul_(nu)
        return directions


VARIANTS: dict[str, dict[str, Any]] = {
    "sgd": {},
    "default": {},
    "lr_squared": {"update": UpdateConfig(trust_region="lr_squared")},
    "lr_squared damping 0.01": {"update": UpdateConfig(trust_region="lr_squared"), "damping": 0.01},
    "lr_squared damping 1": {"update": UpdateConfig(trust_region="lr_squared"), "damping": 1.0},
    "lr_squared intervals 1/1": {"update": UpdateConfig(trust_region="lr_squared"), "factor_update_steps": 1,
                                 "decomposition_update_steps": 1},
    "base_lr 1e-3": {"update": UpdateConfig(trust_region="base_lr"), "kl_clip": 1e-3},
    "no clip": {"kl_clip": None},
    "default damping 0.01": {"damping": 0.01},
    "default damping 1": {"damping": 1.0},
    "default intervals 1/1": {"factor_update_steps": 1, "decomposition_update_steps": 1},
    "default kl_clip 0.1": {"kl_clip": 0.1},
    "euclidean": {"length": "euclidean"},
    "layer": {"length": "layer"},
    "floor": {"length": "floor"},
    "floor kl_clip 0.1": {"length": "floor", "kl_clip": 0.1},
    "floor kl_clip 1e-3": {"length": "floor", "kl_clip": 1e-3},
}


def _optimizer(variant: str, model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer:
    if variant == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    settings = dict(VARIANTS[variant])
    length = settings.pop("length", None)
    if length is None:
        return KFAC(model, lr=lr, momentum=momentum, **settings)
    kl_clip = settings.get("kl_clip", KFAC(nn.Linear(1, 1)).options.kl_clip)
    with unittest.mock.patch.object(kfac_optim.optimizer, "step_length_for",  # a rule the library does not ship
                                    lambda *args: AlternativeLength(kl_clip, length)):
        return KFAC(model, lr=lr, momentum=momentum, **settings)


def final_loss(task: str, variant: str, lr: float, momentum: float, seed: int, steps: int) -> float:
    """The mean loss on 4 held-out batches after ``steps`` steps of ``variant`` from ``seed``."""
    build, batch, loss_fn = TASKS[task]
    torch.manual_seed(seed)
    model = build()
    optimizer = _optimizer(variant, model, lr, momentum)
    generator = torch.Generator().manual_seed(1000 + seed)
    for _ in range(steps):
        x, y = batch(generator)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    held_out = torch.Generator().manual_seed(99)
    with torch.no_grad():
        return sum(float(loss_fn(model(x), y)) for x, y in (batch(held_out) for _ in range(4))) / 4


def length_ratios(task: str, variant: str, lr: float, steps: int = 10) -> list[float]:
    """``‖ν·V‖ / ‖∇‖`` over the K-FAC parameters at each of the first ``steps`` steps (momentum 0)."""
    build, batch, loss_fn = TASKS[task]
    torch.manual_seed(0)
    model = build()
    optimizer = _optimizer(variant, model, lr, 0.0)
    generator, ratios = torch.Generator().manual_seed(1000), []
    for _ in range(steps):
        x, y = batch(generator)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        grads = {p: p.grad.clone() for block in optimizer.blocks for p in block.parameters() if p.grad is not None}
        before = {p: p.detach().clone() for p in grads}
        optimizer.step()
        change = torch.cat([(before[p] - p.detach()).reshape(-1) for p in grads]) / lr
        ratios.append(float(change.norm() / torch.cat([g.reshape(-1) for g in grads.values()]).norm()))
    return ratios


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--momenta", nargs="+", type=float, default=[0.0, 0.9])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--ratios", action="store_true", help="print ‖ν·V‖/‖∇‖ of the first steps (momentum 0)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for task in args.tasks:
        for momentum in args.momenta:
            for variant in args.variants:
                row = [sum(final_loss(task, variant, lr, momentum, seed, args.steps) for seed in range(args.seeds))
                       / args.seeds for lr in LRS]
                results[f"{task} momentum={momentum} {variant}"] = dict(zip(map(str, LRS), row, strict=True))
                print(f"{task:10s} momentum={momentum} {variant:26s} "  # noqa: T201 (a command-line report)
                      + " ".join(f"{v:9.4f}" for v in row), flush=True)
        if args.ratios:
            for variant in (v for v in args.variants if v != "sgd"):
                for lr in (0.01, 0.1):
                    ratios = length_ratios(task, variant, lr)
                    print(f"{task:10s} {variant:26s} lr={lr}: |nu V|/|grad| steps 0,1,5,9: "  # noqa: T201
                          + " ".join(f"{ratios[i]:.3g}" for i in (0, 1, 5, 9)), flush=True)
    return results


if __name__ == "__main__":
    main()
