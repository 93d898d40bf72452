"""The distributed recipes' ranks (ddp, fsdp): who this process is under ``torchrun``, its process group.

``torchrun`` sets ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``; a plain ``python`` launch is one
rank. The group is NCCL with one GPU per rank (``--device cuda``), gloo on CPUs.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job, and the device it trains on."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    def shard(self, batch: Tensor) -> Tensor:
        """This rank's rows of a global ``batch`` (``len(batch)`` divisible by the world size), on its device."""
        size = len(batch) // self.world_size
        return batch[self.rank * size : (self.rank + 1) * size].to(self.device)


def torchrun_ranks(device: str, batch_size: int) -> Ranks:
    """Read ``torchrun``'s environment; ``device`` is ``"cpu"`` or ``"cuda"`` (this rank's GPU).

    Exits with a message when the global ``batch_size`` does not split evenly over the ranks.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if batch_size % world_size:
        raise SystemExit(f"--batch-size {batch_size} must be divisible by the {world_size} ranks")
    return Ranks(rank, local_rank, world_size,
                 torch.device("cuda", local_rank) if device == "cuda" else torch.device("cpu"))


@contextmanager
def process_group(ranks: Ranks) -> Iterator[None]:
    """The default process group for the ``with`` block: NCCL on GPUs, gloo on CPUs.

    Destroyed at the end, after freeing garbage (DDP's reducer, FSDP's state, collectives' work
    objects): freed later, during interpreter shutdown, gloo's threads can abort the process.
    """
    if ranks.device.type == "cuda":
        torch.cuda.set_device(ranks.device)
    dist.init_process_group("nccl" if ranks.device.type == "cuda" else "gloo")
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()
