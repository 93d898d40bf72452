"""Shared test helpers: small models' batches, dense references, optimizer state snapshots.

One definition each (tests/test_test_layout.py checks that no helper name is defined in more
than one test file). The distributed ones (spawning gloo ranks) are in tests/distributed_helpers.py.
"""

from __future__ import annotations

import torch

from kfac_optim import KFAC


def kron_solve(G: torch.Tensor, A: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """(G ⊗ A + λI)⁻¹ vec(∇W) with the row-major vec that torch.kron matches (dense, in G's dtype)."""
    dense = torch.kron(G, A) + damping * torch.eye(G.shape[0] * A.shape[0], dtype=G.dtype)
    return torch.linalg.solve(dense, grad.reshape(-1)).reshape(grad.shape)


def seeded_batch(
    input_shape: tuple[int, ...], classes: int, seed: int, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: ``x`` standard normal of ``input_shape`` (in ``dtype``, default the default
    dtype), then ``y`` uniform class labels in ``[0, classes)``, one per row of ``x``; both drawn,
    in that order, from one generator seeded with ``seed`` (the same batch for the same arguments)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(input_shape, generator=generator, dtype=dtype)
    return x, torch.randint(0, classes, (input_shape[0],), generator=generator)


def running_factors(optimizer: KFAC) -> dict[str, torch.Tensor]:
    """A copy of every block's running factors, ``{"<block>.<A|G>": (dim, dim)}`` (later steps
    update them in place)."""
    return {f"{b.name}.{n}": f.running.clone() for b in optimizer.blocks for n, f in b.factors.items()}
