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
import gc
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import kfac_optim
from examples.recipes.toy import toy_batches, toy_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.recipes.ddp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun, with RANK and LOCAL_RANK
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if args.batch_size % world_size:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world_size} ranks")
    model = toy_model()
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        model = DistributedDataParallel(model.to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    else:
        model = model.to(device)
    optimizer = kfac_optim.KFAC(model, lr=0.1, momentum=0.9, weight_decay=5e-4)
    try:
        shard = args.batch_size // world_size
        for step, (x, y) in enumerate(toy_batches(args.steps, args.batch_size)):
            x, y = x[rank * shard:(rank + 1) * shard].to(device), y[rank * shard:(rank + 1) * shard].to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:3d}  loss (rank 0's shard) {loss.item():.4f}")
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if world_size > 1:
            reference = params.clone()
            dist.broadcast(reference, src=0)
            identical = torch.equal(params, reference)
            flags = torch.tensor([int(identical)], device=device)
            dist.all_reduce(flags)
            if rank == 0:
                print(f"{world_size} ranks, parameters bit-identical on every rank: {int(flags) == world_size}")
            if int(flags) != world_size:
                return 1
        return 0
    finally:
        if dist.is_initialized():
            gc.collect()  # free DDP's reducer and pending work while the group is alive
            dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
