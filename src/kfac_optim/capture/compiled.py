"""The capture's gradient hook in a form ``torch.compile`` traces without a graph break.

Owns: :class:`TapSite` (where a compiled forward taps a layer output: the capture, the block and
how the layer input is rebuilt from its tensor), :func:`traced_tap` (what the forward hook returns
while Dynamo traces it) and the ``kfac_optim::record_gradient`` custom op behind it.
Must not know: which backward records, holding or summing output-gradients, factor math: the op
hands the pair to the capture (a :class:`Recorder`: ``StatisticsCapture.record_traced``), which
applies the eager rules (docs/design.md §4, "Compiled models").

How (docs/design.md §4): a tensor hook registered in a traced forward is a Python side effect
Dynamo cannot keep (a graph break at every hooked layer; ``fullgraph=True`` raises "HOP:
Non-nullified side effect"). Instead the forward hook applies :class:`_Tap`, an identity
``autograd.Function`` on the layer output (in place: ``mark_dirty``, so an in-place activation
after the layer still sees the layer's own output-gradient, as with the tensor hook). Its backward
calls ``kfac_optim::record_gradient(layer_input, grad_output, site)``, a custom op registered with
an ordered effect: AOT autograd and inductor keep it in the compiled backward graph (neither
eliminated as unused nor reordered) and run it as an opaque Python call at run time, inside the
backward pass's graph task. There the engine queries of the eager rule work as in eager mode
(``layers.hooks.writes_gradient``, ``keeps_graph``, the graph task id), so side passes, frozen
modules, ``retain_graph`` multi-loss sums and ``module.zero_grad()`` behave alike; the pair's math
(``KroneckerBlock.accumulate``) runs eagerly, on the same tensors, with the same results.
Cost: no extra tensor; the layer input is saved for the backward (the layer's own weight gradient
saves it too), and one Python call per tapped layer and backward, as the tensor hook's.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kfac_optim.layers.base import KroneckerBlock

logger = logging.getLogger(__name__)

_site_keys = itertools.count()
_sites: weakref.WeakValueDictionary[int, TapSite] = weakref.WeakValueDictionary()
_AUTOGRAD_KEYS: Any = None  # set with the op (_define_op)


class Recorder(Protocol):
    """What a :class:`TapSite` hands its pairs to (the statistics capture)."""

    def record_traced(self, block: KroneckerBlock, layer_input: Any, grad_output: Tensor) -> None:
        """Record one pair of an output tapped in a compiled forward, in the backward pass."""


class TapSite:
    """One place a compiled forward taps a block's output: the ``capture`` (held weakly), the
    ``block``, and ``rebuild``, which turns the layer input's tensor back into what
    :meth:`KroneckerBlock.accumulate` takes (e.g. ``(head, x)`` for a tied head). ``key`` names it
    in the traced graph (an int constant); the capture holds its sites, which live as long as it."""

    def __init__(self, capture: Recorder, block: KroneckerBlock, rebuild: Callable[[Tensor], Any]) -> None:
        self.capture = weakref.ref(capture)
        self.block = block
        self.rebuild = rebuild
        self.key = next(_site_keys)
        _sites[self.key] = self


def _autograd_keys() -> Any:
    """The dispatch keys a custom op's implementation runs without (it is called below autograd)."""
    outside = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._AutoDispatchBelowAutograd():
        return torch._C._dispatch_tls_local_exclude_set() - outside


def _record_gradient(layer_input: Tensor, grad_output: Tensor, site: int) -> None:
    """Run time, in the backward pass: hand the pair to the site's capture (gone: nothing), with
    autograd dispatch back on as around an eager tensor hook (the capture fetches ``AccumulateGrad``
    nodes through autograd: ``layers.hooks.gradient_node``). Grad mode is the backward pass's own."""
    tap_site = _sites.get(site)
    capture = None if tap_site is None else tap_site.capture()
    if capture is None:
        return
    excluded = torch._C._dispatch_tls_local_exclude_set() - _AUTOGRAD_KEYS
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded):
        capture.record_traced(tap_site.block, tap_site.rebuild(layer_input), grad_output)


def _define_op() -> Any | None:
    """``kfac_optim::record_gradient`` (None where this torch has no ``torch.library.custom_op``
    with effects: the capture then keeps its tensor hooks under compile, with their graph breaks)."""
    global _AUTOGRAD_KEYS
    try:
        from torch._library.effects import EffectType

        _AUTOGRAD_KEYS = _autograd_keys()
        op = torch.library.custom_op("kfac_optim::record_gradient", mutates_args=())(_record_gradient)
        op.register_fake(lambda layer_input, grad_output, site: None)
        op.register_effect(EffectType.ORDERED)  # kept and ordered in compiled graphs although it returns nothing
    except (AttributeError, ImportError, TypeError) as error:
        logger.info("compiled capture unavailable in torch %s (%s): tensor hooks are used", torch.__version__, error)
        return None
    return op


_record_op = _define_op()


def available() -> bool:
    """Whether this torch can take the traced capture (else the tensor hooks are kept under compile)."""
    return _record_op is not None


class _Tap(torch.autograd.Function):
    """Identity on a layer output (marked dirty: returned in place, not as a view); its backward
    hands ``(layer_input, grad_output)`` to ``kfac_optim::record_gradient`` and passes the gradient on."""

    @staticmethod
    def forward(output: Tensor, layer_input: Tensor, site: int) -> Tensor:
        return output

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, int], output: Tensor) -> None:
        ctx.mark_dirty(inputs[0])
        ctx.save_for_backward(inputs[1])
        ctx.site = inputs[2]

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        (layer_input,) = ctx.saved_tensors
        torch.ops.kfac_optim.record_gradient(layer_input, grad_output, ctx.site)
        return grad_output, None, None


def traced_tap(output: Tensor, layer_input: Tensor, site: TapSite) -> Tensor:
    """``output``, tapped for ``site`` (call while Dynamo traces; ``layer_input`` detached)."""
    return _Tap.apply(output, layer_input, site.key)
