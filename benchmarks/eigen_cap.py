"""What the eigenbasis cap (``Eigen(max_rank=...)``, docs/api.md "Eigenbasis cap") saves on ResNet-18.

Usage: ``python -m benchmarks.eigen_cap [--caps none 512 256 128 64] [--fold-steps 12] [--threads 1]``.

Trains torchvision's ResNet-18 (32 px, batch 64) for ``--fold-steps`` steps with a factor step on
each, so that its factors are full rank (layer3's 2304-wide ``A`` needs 9 batches of 256 rows),
then, per cap: decomposes every factor with ``Eigen(max_rank=cap)`` (one round, timed) and times
each block's preconditioning of the last gradient (the fastest of 3). Prints the forward+backward
time of one batch (hooks detached: SGD's work), the round and the preconditioning per cap, the
cosine between the whole direction (all blocks) at each cap and at the first one (full
eigenbases by default), the smallest such cosine of one block's direction, and the blocks that cost
more than 5 ms at some cap.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.step_time import build_model
from kfac_optim import KFAC
from kfac_optim.methods import Eigen


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", nargs="+", default=["none", "512", "256", "128", "64"])
    parser.add_argument("--fold-steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model("resnet18", 32).train()
    optimizer = KFAC(model, lr=0.05, factor_update_steps=1, decomposition_update_steps=1000,
                     method=Eigen(max_rank=None))
    generator = torch.Generator().manual_seed(1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(64, 3, 32, 32, generator=generator), torch.randint(0, 10, (64,), generator=generator)

    for _ in range(args.fold_steps):
        x, y = batch()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    optimizer.remove_hooks()
    sgd_work = []
    for _ in range(3):
        x, y = batch()
        start = time.perf_counter()
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sgd_work.append(time.perf_counter() - start)
    print(f"forward+backward (SGD's work) {min(sgd_work) * 1e3:.0f} ms")  # noqa: T201
    damping = optimizer.damping_at(optimizer.steps)
    results: dict[str, dict[str, float]] = {}
    references: list[torch.Tensor] = []
    for cap in args.caps:
        method = Eigen(max_rank=None if cap == "none" else int(cap))
        start = time.perf_counter()
        for block in optimizer.blocks:
            thresholds = block.rank_thresholds(method, damping)
            for name, factor in block.factors.items():
                factor.adopt(method.decompose(factor, 0.0, torch.float32, thresholds[name]), 0.0)
        decompositions = time.perf_counter() - start
        per_block, directions = {}, []
        for block in optimizer.blocks:
            grad = block.grad_matrix()
            samples = []
            for _ in range(3):
                start = time.perf_counter()
                direction = block.precondition(grad, method, damping)
                samples.append(time.perf_counter() - start)
            per_block[block.name] = min(samples)
            directions.append(direction.reshape(-1).double())
        references = directions if not results else references
        cosine = float(F.cosine_similarity(torch.cat(directions), torch.cat(references), dim=0))
        worst = min(float(F.cosine_similarity(d, r, dim=0)) for d, r in zip(directions, references, strict=True))
        results[cap] = {"decompositions_s": decompositions, "precondition_s": sum(per_block.values()),
                        "cosine_to_first": cosine, "worst_block_cosine_to_first": worst,
                        **{f"precondition_s {name}": t for name, t in per_block.items()}}
        print(f"max_rank={cap}: decompositions {decompositions:.2f} s, preconditioning "  # noqa: T201
              f"{sum(per_block.values()) * 1e3:.0f} ms, direction's cosine to max_rank={args.caps[0]}'s {cosine:.4f} "
              f"(worst block {worst:.4f})", flush=True)
    for block in optimizer.blocks:
        times = [results[cap][f"precondition_s {block.name}"] * 1e3 for cap in args.caps]
        if max(times) > 5:
            print(f"  {block.name}: " + " ".join(f"{t:.1f}" for t in times) + " ms")  # noqa: T201
    return results


if __name__ == "__main__":
    main()
