"""Saved state: the one protocol through which every owner of checkpoint state saves and loads it.

Owns :class:`Stateful` (an owner's ``state_dict`` / ``check_state`` / ``load_state_dict``), how
owners compose (:func:`save_children`, :func:`check_children`, :func:`load_children`: each child's
state under its key, as ``nn.Module`` composes ``state_dict``), :func:`within` (an error in a
child's part names the child), and the checks every owner shares (a field is a finite tensor;
a field has the shape this model needs), each a ``ValueError`` naming the field.
Must not know: which owners exist or what they hold (each owner does); the checkpoint's framing
(``checkpoint.py``). Composition and errors: docs/design.md §5 "Checkpoints".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import Tensor


class Stateful(Protocol):
    """An owner of checkpoint state. Loading is checked whole before anything changes: a parent
    checks every child's part (:meth:`check_state`), then loads them (:meth:`load_state_dict`)."""

    def state_dict(self) -> Any:
        """This owner's state (its children's under their keys); local, never a collective."""

    def check_state(self, state: Any) -> None:
        """Raise ``ValueError`` naming the key and the reason if ``state`` (a :meth:`state_dict`;
        None: nothing saved) does not fit this owner; nothing is changed."""

    def load_state_dict(self, state: Any) -> None:
        """Restore a checked ``state``."""


class StateError(ValueError):
    """A misfit in saved state: ``path``, the labels of the owners down to it, and ``reason``."""

    def __init__(self, reason: str, path: tuple[str, ...] = ()) -> None:
        super().__init__(f"{', '.join(path)}: {reason}" if path else reason)
        self.reason, self.path = reason, path


@contextmanager
def within(label: str) -> Iterator[None]:
    """Name ``label`` (a child's key, e.g. ``"layer 'fc'"``) in front of a ``ValueError`` raised inside."""
    try:
        yield
    except StateError as error:
        raise StateError(error.reason, (label, *error.path)) from None
    except ValueError as error:
        raise StateError(str(error), (label,)) from None


def save_children(children: Mapping[str, Stateful]) -> dict[str, Any]:
    """``{key: child.state_dict()}``, in the children's order."""
    return {key: child.state_dict() for key, child in children.items()}


def check_children(children: Mapping[str, Stateful], state: Mapping[str, Any]) -> None:
    """Check each child's part of ``state`` (a missing key: None, nothing saved), naming its key."""
    for key, child in children.items():
        with within(f"'{key}'"):
            child.check_state(state.get(key))


def load_children(children: Mapping[str, Stateful], state: Mapping[str, Any]) -> None:
    """Load each child's part of a checked ``state``, in the children's order."""
    for key, child in children.items():
        child.load_state_dict(state.get(key))


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
