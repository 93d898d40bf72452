"""How far K-FAC's curvature model is from a batch's empirical Fisher, layer by layer.

Usage: ``python -m benchmarks.zoo.curvature --model timm_convnext [--weight-sharing reduce] [--batch 16]``.

For one zoo model at its initialization and one batch of ``N`` samples, the drop-in's factors are
folded from that batch alone (``factor_update_steps=1``, one step at lr 0), and for each layer
whose ``A`` and ``G`` are dense 2-D matrices (weight+bias as ``W: (out, in [+1])``, the column
order of ``A``) it prints ``d_true(D) / d_kfac(D)`` along two directions ``D``:

- ``d_true(D) = (1/N) Σ_n ⟨∇ℓ_n, D⟩²``: the empirical Fisher of the mean loss, per-sample
  gradients ``∇ℓ_n`` from one backward per sample (on a copy without K-FAC's hooks);
- ``d_kfac(D) = tr(G D A Dᵀ) = vec(D)ᵀ (G ⊗ A) vec(D)``: K-FAC's model, in the same units
  (docs/numerics.md "What N is");
- ``D = ∇`` (SGD's direction, the batch's mean gradient) and ``D = V = (G ⊗ A + λI)⁻¹ ∇`` (the
  eigen method's direction at the damping λ, full eigenbases).

A ratio above 1 says the model underestimates the curvature along ``D``, so a step along it
measured by the model (the trust region's KL estimate, ν) is longer than the model promises; what
matters for K-FAC's step is how the ratio differs between layers (one ν for all of them).
A model with normalization in batch mode (BatchNorm) is refused: its per-sample losses differ from
its batch's. Results: benchmarks/RESULTS.md "Why the drop-in trailed SGD on two ViTs, ConvNeXt and EfficientNet".
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

import kfac_optim
from benchmarks.zoo.models import ZOO, ZooBatch


def _matrix(grads: dict[str, Tensor], weight: str, bias: str | None, out: int) -> Tensor:
    """A layer's gradient as ``(out, in [+1])``, the bias as the last column (``A``'s order)."""
    matrix = grads[weight].reshape(out, -1)
    return torch.cat([matrix, grads[bias][:, None]], 1) if bias else matrix


def ratios(model: nn.Module, loss_of: Callable[[nn.Module, slice], Tensor], samples: int, damping: float = 0.1,
           weight_sharing: str = "expand") -> dict[str, tuple[float, float]]:
    """``{layer's weight name: (d_true/d_kfac along ∇, along V)}`` for ``model`` on ``samples`` samples
    (module docstring); ``loss_of(model, s)``: the mean loss of the samples in slice ``s``."""
    if any(isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)) for m in model.modules()):
        raise ValueError("model has BatchNorm layers: its per-sample losses are not its batch's")
    clone = copy.deepcopy(model)
    per_sample = []
    for n in range(samples):
        clone.zero_grad()
        loss_of(clone, slice(n, n + 1)).backward()
        per_sample.append({k: p.grad.detach().double() for k, p in clone.named_parameters() if p.grad is not None})
    optimizer = kfac_optim.KFAC(model, lr=0.0, damping=damping, factor_update_steps=1, decomposition_update_steps=1,
                                curvature=kfac_optim.CurvatureConfig(weight_sharing=weight_sharing))
    optimizer.zero_grad()
    loss_of(model, slice(0, samples)).backward()
    optimizer.step()  # lr 0: folds this batch's statistics, moves nothing
    names = {id(p): name for name, p in model.named_parameters()}
    found = {}
    for block in optimizer.blocks:
        a, g = block.A.running.double(), block.G.running.double()
        params = block.parameters()
        if a.dim() != 2 or g.dim() != 2:
            continue
        weight, bias = names[id(params[0])], names[id(params[1])] if len(params) > 1 else None
        rows = [_matrix(grads, weight, bias, g.shape[0]) for grads in per_sample]
        mean = sum(rows) / samples
        da, qa = torch.linalg.eigh(a)
        dg, qg = torch.linalg.eigh(g)
        v = qg @ ((qg.T @ mean @ qa) / (dg.clamp(min=0)[:, None] * da.clamp(min=0)[None, :] + damping)) @ qa.T

        def ratio(d: Tensor, rows: list[Tensor] = rows, a: Tensor = a, g: Tensor = g) -> float:
            true = sum(float((row * d).sum()) ** 2 for row in rows) / len(rows)
            return true / float(torch.trace(g @ d @ a @ d.T))

        found[weight] = (ratio(mean), ratio(v))
    return found


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="timm_convnext", choices=sorted(ZOO))
    parser.add_argument("--weight-sharing", default="expand", choices=["expand", "reduce"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    entry = ZOO[args.model]
    torch.manual_seed(args.seed)
    model = entry.build()
    batch = entry.batch(args.batch, torch.Generator().manual_seed(1000 + args.seed))

    def loss_of(module: nn.Module, s: slice) -> Tensor:
        part = ZooBatch(tuple(x[s] for x in batch.args), {k: v[s] for k, v in batch.kwargs.items()},
                        None if batch.target is None else batch.target[s])
        return entry.loss(module, part)

    found = ratios(model, loss_of, args.batch, weight_sharing=args.weight_sharing)
    print(f"| layer ({args.model}, {args.weight_sharing}) | true/K-FAC along ∇ | along V |\n|---|---|---|")  # noqa: T201
    for name, (along_grad, along_v) in found.items():
        print(f"| {name} | {along_grad:.3g} | {along_v:.3g} |")  # noqa: T201
    return found


if __name__ == "__main__":
    main()
