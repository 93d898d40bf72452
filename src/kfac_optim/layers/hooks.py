"""What every capture hook shares: the backward pass being recorded, and the inert placeholder.

Owns: which autograd graph task (one backward pass) an output-gradient belongs to, also when it is
recorded later on another thread (:func:`in_graph_task`); which samples a recorded pair holds (the
model call it came from and the mask of its real positions: :func:`recording_pair`,
:func:`current_samples`, :func:`current_call_samples`, :func:`current_mask`); whether the running backward pass writes
a parameter's ``.grad`` (:func:`gradient_node`, :func:`writes_gradient`) and keeps its graph for
another (:func:`keeps_graph`); :class:`InertHook`, what a copied or
pickled model gets in place of a capture hook, and :class:`CopiedAsInert`, the base of hook
objects that turn into one.
Must not know: blocks, factors, the capture itself (``kfac_optim.capture.hooks`` and the blocks that
install their own hooks, e.g. ``layers.attention``, build on this module; it imports nothing of
the package).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

_replayed_task = threading.local()
_pair = threading.local()


def current_graph_task() -> int:
    """The autograd graph task (one backward pass) whose output-gradients are being recorded:
    the one running on this thread (-1: none), or the one :func:`in_graph_task` replays."""
    task: int | None = getattr(_replayed_task, "id", None)
    return torch._C._current_graph_task_id() if task is None else task


@contextlib.contextmanager
def in_graph_task(task: int) -> Iterator[None]:
    """Record statistics captured in graph task ``task`` as if inside it, on another thread (the
    statistics worker of ``RuntimeConfig(async_statistics=True)``): per-backward bookkeeping such as
    :meth:`KroneckerBlock.count_samples` sees the backward pass the pair came from."""
    _replayed_task.id = task
    try:
        yield
    finally:
        _replayed_task.id = None


@contextlib.contextmanager
def recording_pair(call: int, mask: torch.Tensor | None, samples: int | None = None,
                   rows: int | None = None) -> Iterator[None]:
    """While a block takes one captured pair: it came from forward call ``call`` of the model (the
    capture's count of the model's calls; -1: none, outside the capture), ``mask`` says
    which of its positions are real (None: all; see ``KroneckerBlock.mask_of``), ``samples`` is
    how many samples that call holds (N, what the loss averages over; None: unknown, the block
    counts its input's dim 0) and ``rows`` the dim 0 of the call's input (None: unknown)."""
    _pair.call, _pair.mask, _pair.samples, _pair.rows = call, mask, samples, rows
    try:
        yield
    finally:
        _pair.call, _pair.mask, _pair.samples, _pair.rows = -1, None, None, None


def current_samples() -> tuple[int, int]:
    """Which samples the pair being recorded holds, as ``(graph task, model call)``: two calls of a
    module in one backward pass hold the same samples exactly when they came from one call of the
    model (time steps of an RNN cell, a weight-tied layer applied twice) and different samples
    when they came from different calls (chunks of a batch; docs/numerics.md, 'What N is')."""
    return current_graph_task(), getattr(_pair, "call", -1)


def current_call_samples() -> tuple[int | None, int | None]:
    """``(samples, rows)`` of the model call the pair being recorded came from: N, the samples its
    loss averages over (docs/numerics.md, "What N is"), and the dim 0 of its input; None: unknown."""
    return getattr(_pair, "samples", None), getattr(_pair, "rows", None)


def current_mask() -> torch.Tensor | None:
    """The real positions of the pair being recorded (a bool mask over its leading dims), or None."""
    return getattr(_pair, "mask", None)


def gradient_node(param: torch.Tensor) -> torch.autograd.graph.Node:
    """The ``AccumulateGrad`` node that writes ``param.grad`` (``param``: a leaf that requires grad).
    Fetching it costs tens of µs: callers keep it, which also keeps it the node of later graphs."""
    return torch.autograd.graph._get_grad_fn_or_grad_acc(param)


def writes_gradient(node: torch.autograd.graph.Node) -> bool:
    """Whether the backward pass running on this thread executes ``node`` (a :func:`gradient_node`),
    i.e. writes its parameter's ``.grad``: True for ``loss.backward()``, False for
    ``torch.autograd.grad`` (over parameters or inputs) and for passes that do not reach it. A pure
    graph-task lookup (no tensor is read); call it only inside a backward pass."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf captured by torch.autograd.grad: its .grad is not written
        return False


def keeps_graph() -> bool:
    """Whether the backward pass running on this thread keeps its graph (``retain_graph`` or
    ``create_graph``), i.e. whether a later backward of the same forward may follow."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


class InertHook:
    """What a copied or pickled model gets in place of a capture hook: it does nothing."""

    def __call__(self, *args: Any) -> None:
        return None


class CopiedAsInert:
    """A hook object that a deep-copied or pickled model gets as an :class:`InertHook`: a hook
    records only for the module object it was registered on (docs/design.md §4, "Capture lifecycle")."""

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        return InertHook()

    def __reduce__(self) -> tuple[type[InertHook], tuple[()]]:
        return InertHook, ()
