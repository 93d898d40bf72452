"""K-FAC on a model sharded with FSDP2 (``fully_shard``), with a DCP checkpoint in the middle.

    torchrun --standalone --nproc_per_node=2 -m examples.recipes.fsdp                  # 2 CPU ranks, gloo
    torchrun --standalone --nproc_per_node=4 -m examples.recipes.fsdp --device cuda    # NCCL, a GPU per rank

Every rank trains on its shard of each global batch; parameters, gradients and momentum are
row-sharded ``DTensor``s. Halfway (right after a decomposition step) the model, the optimizer and
K-FAC's own state are saved with ``torch.distributed.checkpoint``; a fresh model and optimizer
load them and train the second half again. Rank 0 prints the losses and whether the resumed run
ends where the straight one did (it must: the saved factors are those the decompositions were
computed from).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import kfac_optim
from examples.recipes.ranks import Ranks, process_group, torchrun_ranks
from examples.recipes.toy import toy_batches, toy_model

DECOMPOSITION_STEPS = 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m examples.recipes.fsdp", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL, one GPU per rank")
    parser.add_argument("--steps", type=int, default=20,
                        help="steps in all; the checkpoint follows the middle decomposition step")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    return parser.parse_args(argv)


def sharded_toy_model(device: torch.device) -> nn.Module:
    model = toy_model().to(device)
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def train(model: nn.Module, optimizer: kfac_optim.KFAC, batches: list, steps: range, ranks: Ranks) -> None:
    for step in steps:
        x, y = batches[step]
        x, y = ranks.shard(x), ranks.shard(y)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if ranks.rank == 0 and (step % 5 == 0 or step == len(batches) - 1):
            print(f"step {step:3d}  loss (rank 0's shard) {loss.item():.4f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ranks = torchrun_ranks(args.device, args.batch_size)
    rank, device = ranks.rank, ranks.device
    batches = toy_batches(args.steps, args.batch_size)
    middle = (args.steps // 2) // DECOMPOSITION_STEPS * DECOMPOSITION_STEPS + 1  # steps up to a decomposition step
    with process_group(ranks):
        model = sharded_toy_model(device)
        optimizer = kfac_optim.KFAC(model, lr=0.1, momentum=0.9, factor_update_steps=1, decomposition_update_steps=DECOMPOSITION_STEPS)
        train(model, optimizer, batches, range(middle), ranks)
        path = tempfile.mkdtemp() if rank == 0 else None
        shared = [path]
        dist.broadcast_object_list(shared, src=0)
        path = shared[0]

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "kfac": optimizer.kfac_state()}, checkpoint_id=path)
        train(model, optimizer, batches, range(middle, args.steps), ranks)
        straight = [p.detach().full_tensor() for p in model.parameters()]

        model = sharded_toy_model(device)  # a fresh run resumes from the checkpoint
        optimizer = kfac_optim.KFAC(model, lr=0.1, momentum=0.9, factor_update_steps=1,
                                    decomposition_update_steps=DECOMPOSITION_STEPS)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd, "kfac": optimizer.kfac_state()}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        train(model, optimizer, batches, range(middle, args.steps), ranks)
        resumed = [p.detach().full_tensor() for p in model.parameters()]
        difference = max(float((a - b).abs().max()) for a, b in zip(straight, resumed, strict=True))
        if rank == 0:
            print(f"{ranks.world_size} ranks, resumed from the DCP checkpoint after {middle} steps; "
                  f"max parameter difference to the straight run {difference:.2e}: {difference <= 1e-6}")
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path)
        return 0 if difference <= 1e-6 else 1


if __name__ == "__main__":
    raise SystemExit(main())
