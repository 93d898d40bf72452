"""K-FAC under DistributedDataParallel: gloo on CPU, NCCL on GPUs, the same script under torchrun.

    torchrun --standalone --nproc_per_node=2 -m examples.recipes.ddp                  # 2 CPU ranks, gloo
    torchrun --standalone --nproc_per_node=4 -m examples.recipes.ddp --device cuda    # NCCL, a GPU per rank
    python -m examples.recipes.ddp                                                    # one process

Every rank trains on its shard of each global batch. DDP averages the gradients; K-FAC averages
the factors and shares the decompositions (docs/design.md §5). At the end every rank compares its
parameters with rank 0's: they must be bit-identical. Rank 0 prints the losses.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import kfac_optim
from examples.recipes.ranks import Ranks, process_group, torchrun_ranks
from examples.recipes.toy import toy_batches, toy_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.recipes.ddp", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ranks = torchrun_ranks(args.device, args.batch_size)
    with process_group(ranks) if ranks.world_size > 1 else nullcontext():
        return train(args, ranks)


def train(args: argparse.Namespace, ranks: Ranks) -> int:
    """Train on this rank's shards; 0 when every rank ends with rank 0's parameters, bit for bit."""
    device = ranks.device
    model = toy_model().to(device)
    if ranks.world_size > 1:
        model = DistributedDataParallel(model, device_ids=[ranks.local_rank] if device.type == "cuda" else None)
    optimizer = kfac_optim.KFAC(model, lr=0.1, momentum=0.9, weight_decay=5e-4)
    for step, (x, y) in enumerate(toy_batches(args.steps, args.batch_size)):
        x, y = ranks.shard(x), ranks.shard(y)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if ranks.rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss (rank 0's shard) {loss.item():.4f}")
    if ranks.world_size == 1:
        return 0
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = params.clone()
    dist.broadcast(reference, src=0)
    flags = torch.tensor([int(torch.equal(params, reference))], device=device)
    dist.all_reduce(flags)
    if ranks.rank == 0:
        print(f"{ranks.world_size} ranks, parameters bit-identical on every rank: {int(flags) == ranks.world_size}")
    return 0 if int(flags) == ranks.world_size else 1


if __name__ == "__main__":
    raise SystemExit(main())
