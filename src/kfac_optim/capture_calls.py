"""The chunked-forward rule: which call of the model given to KFAC a tapped pair belongs to.

Owns: the forward pre-hook on that model (:class:`ModelCallStart`) and the test whether a call
continues the previous one (:func:`computed_from`: its inputs were computed from an output tapped
in that call, a recurrence run call by call).
Must not know: blocks, factors, the backward pass; the capture (``capture.py``) keeps the count
and the tapped outputs' autograd nodes, and calls these.

Which samples a pair holds (docs/design.md §3, "What N is"): a forward pre-hook on the model given
to KFAC counts its calls (a call whose inputs were computed from an output tapped in the previous
call continues it: a recurrence run call by call), and each pair carries the call it came from; a
block counts N once per backward pass and model call (``KroneckerBlock.count_samples``), so a
module called several times within one forward of the model (an RNN cell over time steps) counts
its samples once, and chunks of a batch each run through the model
(``torch.cat([model(c) for c in x.split(16)])``) count theirs per call. Under ``KFAC.mask`` (:meth:`StatisticsCapture.masked`) each pair also
carries the real positions of its forward, fitted to its layer's input by the block
(``KroneckerBlock.mask_of``; ``layers.positions``). Forwards inside a ``torch.func`` transform
(``torch.func.grad``, ``vmap``) are not hooked: their gradients never reach a tensor hook of the
backward that writes ``.grad`` (:attr:`StatisticsCapture.transformed_skipped`, warned once by the
estimator). A block whose layer takes the SGD path (``KroneckerBlock.sgd_reason``) is not hooked.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from kfac_optim.layers.hooks import CopiedAsInert


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


def computed_from(tensors: list[Any], nodes: set[Any]) -> bool:
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
