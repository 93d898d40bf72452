"""Shared test helpers: small models' batches, dense references, optimizer state snapshots.

One definition each (tests/test_test_layout.py checks that no helper name is defined in more
than one test file). The distributed ones (spawning gloo ranks) are in tests/distributed_helpers.py.
"""

from __future__ import annotations

import torch


def kron_solve(G: torch.Tensor, A: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """(G ⊗ A + λI)⁻¹ vec(∇W) with the row-major vec that torch.kron matches (dense, in G's dtype)."""
    dense = torch.kron(G, A) + damping * torch.eye(G.shape[0] * A.shape[0], dtype=G.dtype)
    return torch.linalg.solve(dense, grad.reshape(-1)).reshape(grad.shape)
