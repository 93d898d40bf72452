"""The model's calls: which call of the model given to KFAC a tapped pair belongs to, and what that
call says about its samples and its padding.

Owns: the forward pre-hook on that model (:class:`ModelCallStart`); :class:`ModelCall`, what one
call holds (its number, N, the rows of its input, its real positions) and how it is read from the
call's arguments (:func:`read_call`); the test whether a call continues the previous one
(:func:`computed_from` over :func:`tensors_in` its arguments: its inputs were computed from an
output tapped in that call, a recurrence run call by call, also through a dataclass or a cache
object such as Hugging Face's ``DynamicCache``).
Must not know: blocks, factors, the backward pass; the capture (``capture.hooks``) keeps the count,
the current call and the tapped outputs' autograd nodes, and calls these.

The rules (docs/numerics.md, "Whose samples a call holds", "What N is" and "Padding"): each pair
carries the call it came from and a block counts N once per backward pass and model call
(``KroneckerBlock.count_samples``). N is the call's: stated with ``KFAC.samples(n)``, else the
sequences of packed rows (``cu_seq_lens_q`` / ``cu_seqlens`` keywords, or the restarts of
``position_ids``), else dim 0 of the call's first tensor argument; else unknown (each block counts
its input's dim 0, warned once). An ``attention_mask`` keyword ``(N, T)`` or a ``KFAC.mask`` around
the call gives its real positions, which travel with its pairs (also to a forward recomputed by
reentrant activation checkpointing).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from kfac_optim.layers.hooks import CopiedAsInert
from kfac_optim.layers.positions import RealPositions

logger = logging.getLogger(__name__)

PACKED_LENGTHS = ("cu_seq_lens_q", "cu_seqlens_q", "cu_seqlens")
"""Keywords holding the cumulative sequence lengths of packed rows ``(S + 1,)`` (flash-attention
varlen; Hugging Face's ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): S sequences."""


class ModelCall(NamedTuple):
    """One independent call of the model (or a ``KFAC.samples`` block): ``index``, the capture's
    count of calls; ``samples``: N, the samples its loss averages over (None: unknown, each block
    counts its input's dim 0); ``rows``: dim 0 of its first tensor argument (None: none); and
    ``positions``: its real positions (``attention_mask=`` or ``KFAC.mask``; None: all)."""

    index: int
    samples: int | None = None
    rows: int | None = None
    positions: RealPositions | None = None


NO_CALL = ModelCall(0)


def read_call(index: int, args: tuple[Any, ...], kwargs: dict[str, Any], stated: int | None,
              positions: RealPositions | None) -> tuple[ModelCall, str | None]:
    """The :class:`ModelCall` number ``index`` made of a call's ``args``, ``kwargs`` (see the module
    docstring for the rule), with N ``stated`` (``KFAC.samples``; None: read it) and the real
    ``positions`` of a ``KFAC.mask`` around the call (None: its ``attention_mask`` keyword, if any);
    and why an ``attention_mask`` keyword was not used (None: it was, or there is none). Host
    syncs: one to count an ``attention_mask``'s real positions, one to count ``position_ids``'
    restarts (only when that keyword is given)."""
    rows = None
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor) and value.dim() >= 1:
            rows = value.shape[0]
            break
    unused = None
    mask = kwargs.get("attention_mask")
    if positions is None and mask is not None:
        positions, unused = _attention_positions(mask, rows)
    samples = stated if stated is not None else _packed_sequences(kwargs, positions, rows)
    return ModelCall(index, rows if samples is None else samples, rows, positions), unused


def _attention_positions(mask: Any, rows: int | None) -> tuple[RealPositions | None, str | None]:
    """The real positions of an ``attention_mask`` keyword, or None and why it is not one K-FAC
    reads (a 2-D bool or 0/1 integer tensor whose dim 0 is the call's batch)."""
    if not isinstance(mask, Tensor):
        return None, f"it is a {type(mask).__name__}, not a tensor"
    if mask.dim() != 2 or mask.dtype.is_floating_point or mask.dtype.is_complex or mask.shape[0] != rows:
        return None, (f"K-FAC reads a (batch, length) bool or 0/1 integer mask, got shape {tuple(mask.shape)}, "
                      f"dtype {mask.dtype}")
    return RealPositions.of(mask), None


def _packed_sequences(kwargs: dict[str, Any], positions: RealPositions | None, rows: int | None) -> int | None:
    """The number of sequences of packed rows: from cumulative lengths (a shape: no sync), or the
    restarts of ``position_ids`` ``(B, T)`` at real positions (a real position whose id is not
    the previous real position's + 1 starts a sequence) when B is the call's ``rows`` (not ids
    broadcast over the batch); None when the call has neither."""
    for name in PACKED_LENGTHS:
        lengths = kwargs.get(name)
        if isinstance(lengths, Tensor) and lengths.dim() == 1 and lengths.numel() >= 1:
            return lengths.numel() - 1
    ids = kwargs.get("position_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.shape[0] != rows:
        return None
    real = torch.ones_like(ids, dtype=torch.bool) if positions is None or positions.mask.shape != ids.shape \
        else positions.mask
    follows = torch.zeros_like(real)
    follows[:, 1:] = real[:, 1:] & real[:, :-1] & (ids[:, 1:] == ids[:, :-1] + 1)
    return int((real & ~follows).sum())


_ATOMS = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


def tensors_in(value: Any, depth: int = 4) -> list[Tensor]:
    """The tensors held by ``value``: itself, the items of lists, tuples, sets and dicts, the fields
    of dataclasses and the attributes of other objects (a cache object), ``depth`` objects deep
    (modules, types and functions are not entered)."""
    found: list[Tensor] = []
    stack, seen = [(value, depth)], set()
    while stack:
        item, left = stack.pop()
        if isinstance(item, Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, set, frozenset, dict)):
            if id(item) not in seen:
                seen.add(id(item))
                stack.extend((v, left) for v in (item.values() if isinstance(item, dict) else item))
        elif (left > 0 and not isinstance(item, _ATOMS) and id(item) not in seen and hasattr(item, "__dict__")
              and not isinstance(item, (nn.Module, type)) and not callable(item)):
            seen.add(id(item))
            stack.extend((v, left - 1) for v in vars(item).values())
    return found


class CallCounter(Protocol):
    """What :class:`ModelCallStart` tells of a call (``capture.StatisticsCapture``)."""

    def model_call_started(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None: ...


class ModelCallStart(CopiedAsInert):
    """The forward pre-hook (``with_kwargs=True``) on the model given to KFAC: a call starts
    (``StatisticsCapture.model_call_started``). Not while Dynamo traces (the count would be a
    guarded constant: a recompile per call): a compiled model's calls do not advance the count, so
    its pairs of one backward pass count as one call."""

    def __init__(self, capture: CallCounter) -> None:
        self._capture = weakref.ref(capture)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        capture = self._capture()
        if capture is not None and not torch.compiler.is_compiling():
            capture.model_call_started(args, kwargs)


def computed_from(tensors: Iterable[Any], nodes: set[Any]) -> bool:
    """Whether any of ``tensors`` was computed from an output whose autograd node is in ``nodes``
    (a walk of their graphs back to the leaves, stopping at the first such node)."""
    stack = [t.grad_fn for t in tensors if isinstance(t, Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in nodes:
            return True
        if node in seen:
            continue
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return False
