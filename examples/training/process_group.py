"""Process-group setup for `torchrun`, and the few collectives the trainer needs.

Under `torchrun` (WORLD_SIZE > 1 in the environment) one process group is created per job:
NCCL when the device is CUDA, gloo on CPU. A plain `python` launch is world size 1 and creates
none; every helper here is then a no-op. Knows nothing of models or optimizers.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from examples.training.config import SetupError


@dataclass(frozen=True)
class DistEnv:
    """Where this process runs: its rank, the world size and its device."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 logs, writes files and shows the progress bar."""
        return self.rank == 0


def pick_device(preference: str, local_rank: int) -> torch.device:
    """`auto` -> this rank's GPU when CUDA is available, else the CPU."""
    if preference == "cuda" and not torch.cuda.is_available():
        raise SetupError("train.device=cuda but torch.cuda.is_available() is False")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def setup(device_preference: str) -> DistEnv:
    """Join the `torchrun` job if there is one (idempotent), and pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    return DistEnv(rank=rank, world_size=world_size, device=device)


def teardown() -> None:
    """Leave the process group, if this process joined one.

    Garbage (DDP reducers in reference cycles, collectives' work objects) is freed first: freed
    later, during interpreter shutdown, gloo's threads can abort the process.
    """
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum `tensor` over ranks in place (returns it)."""
    if env.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(value: float, env: DistEnv) -> float:
    """The largest of the ranks' `value`s, on every rank (so decisions made from it agree)."""
    if env.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=env.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def barrier(env: DistEnv) -> None:
    """Wait for every rank."""
    if env.world_size > 1:
        dist.barrier()
