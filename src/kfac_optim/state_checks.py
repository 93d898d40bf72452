"""Checks of saved state: what a checkpoint field must be before anything is restored from it.

Owns the two checks every validator of saved state shares (a field is a finite tensor; a field
has the shape this model needs), each a ``ValueError`` naming the field.
Must not know: which state the fields belong to (factors, decompositions, methods).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def check_tensors(tensors: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the field of a value that is not a tensor or is non-finite."""
    for field, tensor in tensors.items():
        if not isinstance(tensor, Tensor):
            raise ValueError(f"'{field}' must be a tensor, got {type(tensor).__name__}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"'{field}' is non-finite")


def check_shapes(tensors: dict[str, Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    """Raise ``ValueError`` naming the field of a tensor not shaped as ``expected`` says."""
    for field, tensor in tensors.items():
        if tuple(tensor.shape) != expected[field]:
            raise ValueError(f"'{field}' has shape {tuple(tensor.shape)}, this model needs {expected[field]}")
