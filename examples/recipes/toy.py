"""The recipes' shared workload: a small MLP and batches of a synthetic classification task.

Labels come from a fixed random linear "teacher" (``y = argmax(x @ T)``), so the task is
learnable, deterministic and needs no download.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

FEATURES, CLASSES = 32, 10


def toy_model(seed: int = 0) -> nn.Module:
    """``32 -> 64 -> 64 -> 10`` with tanh: three K-FAC layers."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, CLASSES))


def toy_batches(steps: int, batch_size: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """``steps`` batches ``(x: (batch_size, 32), y: (batch_size,))``, the same for every call with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    batches = []
    for _ in range(steps):
        x = torch.randn(batch_size, FEATURES, generator=generator)
        batches.append((x, (x @ teacher).argmax(dim=1)))
    return batches
