"""Hooks that capture layer inputs and output-gradients into the blocks' pending statistics.

Owns: the forward hooks on supported modules, their lifetime, which capture owns a module, and
whether the hooks are armed.
Must not know: factor math (blocks do it), step counting or schedules (the optimizer arms us,
for all modules or, with staggered factor updates, for some: :meth:`StatisticsCapture.arm`).

When armed, a module called with grad enabled and an output that requires grad gets a tensor hook
on that output; when the output-gradient arrives, the (input, output-gradient) pair is handed to
the block, with the model call it came from (``capture.calls``) and that call's real positions
(:meth:`StatisticsCapture.masked`). Nothing is computed in the forward pass.
``register_full_backward_hook`` is deliberately not used (it breaks on in-place ops after the layer).

The rules, each in docs/design.md §4: which backward records ("Which backward records": the one
that writes the parameters' ``.grad``, once per forward; ``retain_graph`` passes summed; side
passes, frozen modules and ``torch.func`` transforms record nothing), eval mode ("Eval mode
records"), double backward and the hooks' lifetime ("Capture lifecycle"), ``torch.compile``
("Compiled models": :meth:`StatisticsCapture.record_traced`), and the statistics worker
("Statistics off the critical path": a pair modified in place before the worker reads it is
dropped and named in :attr:`StatisticsCapture.overwritten`). Which samples a pair holds:
docs/numerics.md, "What N is". With ``every_backward=False`` (the sampled Fisher) pairs are
recorded only inside :meth:`StatisticsCapture.recording`.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfac_optim.background.statistics import StatisticsWorker
from kfac_optim.capture import compiled as compiled_capture
from kfac_optim.capture.calls import NO_CALL, ModelCall, ModelCallStart, computed_from, read_call, tensors_in
from kfac_optim.capture.compiled import TapSite
from kfac_optim.capture.lifetime import remove_hooks, take_over
from kfac_optim.capture.pairs import Tapped, same_tensor, tensors_of
from kfac_optim.diagnostics import warn_user
from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.hooks import (
    CopiedAsInert,
    InertHook,
    current_graph_task,
    gradient_node,
    in_graph_task,
    keeps_graph,
    recording_pair,
    writes_gradient,
)
from kfac_optim.layers.positions import RealPositions

logger = logging.getLogger(__name__)

Accumulate = Callable[[KroneckerBlock, Tensor, Tensor], None]



def accumulate_plainly(block: KroneckerBlock, inputs: Tensor, grad_output: Tensor) -> None:
    """The default hand-off: ``block.accumulate(inputs, grad_output)``."""
    block.accumulate(inputs, grad_output)


class CaptureHook(CopiedAsInert):
    """The forward hook (``with_kwargs=True``) of one of a block's modules (``block.captured_modules()``:
    its own, and e.g. a module sharing its weight); see the module docstring."""

    def __init__(self, capture: StatisticsCapture, block: KroneckerBlock, module: nn.Module) -> None:
        self._capture = weakref.ref(capture)
        self.block = block
        self.module = module
        self.site = capture.site(block, lambda x: block.layer_input((x,), {}, module))

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Tensor | None:
        capture = self._capture()
        if capture is None or module is not self.module or not capture.should_capture(module):
            return None
        if not isinstance(output, Tensor) or not output.requires_grad:
            return None
        return capture.tap(self.block, self.block.layer_input(args, kwargs, module), output, self.site)

    def __deepcopy__(self, memo: dict[int, Any]) -> InertHook:
        inert = InertHook()
        capture, copied_module = self._capture(), memo.get(id(self.module))
        if capture is not None and isinstance(copied_module, nn.Module):
            capture.copies.append((weakref.ref(copied_module), inert))
        return inert


@dataclass(frozen=True)
class Recording:
    """What the capture saw since the last factor step (``kfac_optim.estimator.pipeline.InLineStatistics.recording``).

    ``recorded``: pairs recorded; ``arrivals``: output-gradients that reached the hooks (recorded or
    not); ``transformed``: a forward ran inside a ``torch.func`` transform (not hooked);
    ``graph_backward``: a backward with ``create_graph=True`` was not recorded; ``active``: the
    capture has hooks installed (not removed).
    """

    recorded: int
    arrivals: int
    transformed: bool
    graph_backward: bool
    active: bool


class StatisticsCapture:
    """Forward hooks on every block's module; statistics flow only while ``armed`` is True, and
    then only for the modules in ``only`` (None: all).

    ``accumulate(block, input, output_grad)`` receives each captured pair (the optimizer passes
    one that handles loss scaling, see ``precision``). ``every_backward``: record the
    output-gradients of every backward pass (True) or only those inside :meth:`recording`.
    ``graph_backward_skipped`` is set when an output-gradient of a ``create_graph=True`` backward
    was passed over (the optimizer reports a step whose every backward was such); ``recorded``
    counts the pairs handed on (or to ``worker``) since the caller last reset it, ``arrivals`` the
    output-gradients that reached the hooks (recorded or not) since the caller last reset it. With ``worker``,
    pairs are handed on there unless ``in_line()`` says they must not be now. ``model``: the module
    whose calls delimit samples (see the module docstring; None: every pair of a backward pass
    counts as one call). ``transformed_skipped`` is set when a forward inside a ``torch.func``
    transform was not hooked (the caller resets it). ``resharded(param)``: whether the parameter
    object a module holds after its forward is not the one its backward writes (FSDP2 reshards
    after the forward and unshards again for the backward: ``DistributionStrategy.resharded``).
    """

    def __init__(
        self,
        blocks: Iterable[KroneckerBlock],
        accumulate: Accumulate = accumulate_plainly,
        every_backward: bool = True,
        worker: StatisticsWorker | None = None,
        in_line: Callable[[], bool] = lambda: False,
        model: nn.Module | None = None,
        resharded: Callable[[Tensor], bool] = lambda param: False,
    ) -> None:
        blocks = list(blocks)
        self._resharded = resharded
        self.armed = False
        self.model_calls = 0  # independent forward calls of ``model`` so far (model_call_started)
        self.call: ModelCall = NO_CALL  # the latest call of ``model`` (or KFAC.samples block): its pairs' samples
        self._stated: int | None = None  # N stated by KFAC.samples (stating)
        self._warned: set[str] = set()  # one-time warnings given: "samples", "attention_mask"
        self._call_outputs: set[Any] = set()  # autograd nodes of the outputs tapped in the latest model call
        self.positions: RealPositions | None = None  # the real positions of forwards now (masked)
        self.transformed_skipped = False
        self.only: set[int] | None = None  # armed modules' id()s; None: all
        self.graph_backward_skipped = False
        self.recorded = 0
        self.arrivals = 0
        self.overwritten: set[str] = set()  # blocks whose pair changed before the worker read it
        self._tapped: list[Tensor] = []  # every_backward=False: hooked outputs since the last pass
        self._held: dict[Tapped, None] = {}  # pairs of backward passes that kept their graph, in order
        # blocks handed pairs since the last fold or discard: their last graph task
        self._fed: dict[KroneckerBlock, int] = {}
        self._nodes: dict[KroneckerBlock, tuple[Tensor, Any]] = {}  # the recorded parameter and its AccumulateGrad
        self._warned_replaced: set[str] = set()  # blocks whose module's weight was replaced (_warn_replaced)
        self._sites: list[TapSite] = []  # where compiled forwards tap outputs (compiled_capture)
        self._warned_untraced = False
        self._worker = worker
        self._in_line = in_line
        self.copies: list[tuple[weakref.ref[nn.Module], InertHook]] = []
        self._accumulate = accumulate
        self._recording = every_backward
        self._every_backward = every_backward
        take_over(self, [module for block in blocks for module in block.captured_modules()])
        self._handles: list[RemovableHandle] = []
        for block in blocks:  # a block that captures its own way installs its own hooks
            own = block.install_capture(self)
            if own is None:
                own = [
                    module.register_forward_hook(CaptureHook(self, block, module), with_kwargs=True)
                    for module in block.captured_modules()
                ]
            self._handles.extend(own)
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(ModelCallStart(self), with_kwargs=True))
        self._finalizer = weakref.finalize(self, remove_hooks, self._handles, self.copies)
        self._finalizer.atexit = False  # nothing to clean at interpreter exit, when modules may be half gone


    @property
    def active(self) -> bool:
        """Whether the hooks are still on the model."""
        return self._finalizer.alive

    def arm(self, armed: bool, only: set[int] | None = None) -> None:
        """Arm the hooks (or disarm them), for every module or only those whose ``id()`` is in ``only``."""
        self.armed = armed
        self.only = only
        self._tapped.clear()
        self._call_outputs = set()

    def model_call_started(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A call of the model starts with ``args``, ``kwargs``: it holds new samples
        (:attr:`model_calls` counts on) unless a tensor among them (also inside a dataclass or a
        cache object: ``capture_calls.tensors_in``) was computed from an output tapped in the
        previous call (a recurrence run call by call: the same samples, the same N), or it runs
        inside ``KFAC.samples`` (whose block is one call). The previous call's tapped outputs'
        autograd nodes are held until then or the next step (at most one forward's graph). While
        a forward records (armed, grad enabled), the call's N and real positions are read
        (``capture_calls.read_call``) and its pairs carry them."""
        continues = bool(self._call_outputs) and computed_from(tensors_in((args, kwargs)), self._call_outputs)
        self._call_outputs = set()
        if not continues and self._stated is None:
            self.model_calls += 1
        previous = self.call
        index = previous.index if continues or self._stated is not None else self.model_calls
        if not (self.armed and torch.is_grad_enabled()):
            self.call = ModelCall(index)
            return
        call, unused = read_call(index, args, kwargs, self._stated, self.positions)
        if continues:  # the recurrence's samples are the first call's
            call = call._replace(samples=previous.samples)
        self.call = call
        if unused is not None and "attention_mask" not in self._warned:
            self._warned.add("attention_mask")
            warn_user(f"the model was called with an attention_mask K-FAC does not read ({unused}): its statistics "
                      "count every position; pass the real positions with KFAC.mask()", RuntimeWarning)

    @contextlib.contextmanager
    def stating(self, samples: int) -> Iterator[None]:
        """Forwards run inside are one call holding ``samples`` samples (``KFAC.samples``)."""
        if self._stated is not None:
            raise RuntimeError("KFAC.samples() is already active: it does not nest")
        self.model_calls += 1
        self._call_outputs = set()
        self.call = ModelCall(self.model_calls, samples)
        self._stated = samples
        try:
            yield
        finally:
            self._stated = None

    def should_capture(self, module: nn.Module) -> bool:
        """Whether a forward of ``module`` now records statistics: armed (for it), grad enabled (in
        training or eval mode alike: see the module docstring)."""
        return self.armed and (self.only is None or id(module) in self.only) and torch.is_grad_enabled()

    @contextlib.contextmanager
    def masked(self, positions: RealPositions) -> Iterator[None]:
        """Forwards run inside record only ``positions``' real positions (``KFAC.mask``; the pairs
        keep them until their backward, which may run after the block)."""
        if self.positions is not None:
            raise RuntimeError("KFAC.mask() is already active: masks do not nest")
        self.positions = positions
        try:
            yield
        finally:
            self.positions = None

    def real_positions(self) -> RealPositions | None:
        """The real positions of the forwards now: ``KFAC.mask``'s while it is active, else those of the
        latest model call (its ``attention_mask``, or a ``KFAC.mask`` around it); None: all."""
        return self.positions if self.positions is not None else self.call.positions

    def site(self, block: KroneckerBlock, rebuild: Callable[[Tensor], Any]) -> TapSite:
        """A place where compiled forwards tap ``block``'s output (:meth:`tap`'s ``site``); ``rebuild``
        turns the layer input's tensor into what the block's ``accumulate`` takes. Lives as long as
        this capture."""
        tap_site = TapSite(self, block, rebuild)
        self._sites.append(tap_site)
        return tap_site

    def tap(self, block: KroneckerBlock, layer_input: Any, output: Tensor,
            site: TapSite | None = None) -> Tensor | None:
        """Hook ``output`` so that its gradient is recorded with ``layer_input`` for ``block``
        (:meth:`record`); the hook holds this capture weakly. A block whose weight has
        ``requires_grad=False`` is not hooked (no backward writes its ``.grad``). Without
        ``every_backward`` the output is also held for :meth:`recording_outputs` (until that pass,
        or until the hooks are armed anew at the step: at most one output per layer and forward,
        on factor steps only).

        While ``torch.compile`` traces the forward (with a ``site``, ``every_backward``, and a
        ``layer_input`` that is a tensor or a tuple ending in one): returns ``output`` tapped in the
        traced graph instead, to be used in its place (``compiled_capture``; its backward calls
        :meth:`record_traced`). Otherwise returns None."""
        param = self._recorded_parameter(block)
        if param is None or block.sgd_reason is not None:
            return None
        if torch._C._functorch.maybe_current_level() is not None:
            self.transformed_skipped = True  # torch.func.grad / vmap: see the module docstring
            return None
        if torch.compiler.is_compiling():
            untraced = self._untraced_reason(block, site)
            if untraced is None:
                layer_tensor = layer_input if isinstance(layer_input, Tensor) else layer_input[-1]
                return compiled_capture.traced_tap(output, layer_tensor, site)
            if not self._warned_untraced:
                self._warn_untraced(block, untraced)
        if output.is_nested and not block.takes_nested:
            raise TypeError(f"K-FAC layer '{block.name}' ({type(block).__name__}) cannot record a nested tensor input "
                            "(torch.nested): pad it and pass the mask with KFAC.mask(), or "
                            f"curvature=CurvatureConfig(skip_layers=[{block.name!r}])")
        capture = weakref.ref(self)
        # a compiled model's calls are not read (ModelCallStart): its pairs' N is unknown, only KFAC.mask applies
        compiling = torch.compiler.is_compiling()
        call = ModelCall(self.model_calls) if compiling else self.call
        real = self.positions if self.positions is not None else call.positions  # (real_positions, for this call)
        positions = None if real is None else block.mask_of(layer_input, real)
        if call.samples is None and call.index > 0 and not compiling and "samples" not in self._warned:
            self._warn_unknown_samples(block)
        tapped = self._new_tapped(block, layer_input, param, call, positions)

        def on_gradient(grad_output: Tensor) -> None:
            live = capture()
            if live is not None:
                live.record(tapped, grad_output)

        output.register_hook(on_gradient)
        self._call_outputs.add(output.grad_fn)
        if not self._every_backward:
            self._tapped.append(output)
        return None

    def _warn_unknown_samples(self, block: KroneckerBlock) -> None:
        """Once: the model's call said nothing of its samples, so ``block`` counts its input's dim 0."""
        self._warned.add("samples")
        warn_user(f"K-FAC layer '{block.name}' counts its samples N from dim 0 of its own input: the model was "
                  "called without a tensor argument, so K-FAC cannot tell how many samples the loss averages "
                  "over (docs/numerics.md, 'What N is'); state it with `with optimizer.samples(n):` around the "
                  "forward", RuntimeWarning)

    def _untraced_reason(self, block: KroneckerBlock, site: TapSite | None) -> str | None:
        """Why a compiled forward cannot tap ``block`` in its graph (None: it can)."""
        if not self._every_backward:
            return "the sampled Fisher records in its own pass over the layer outputs"
        if site is None:
            return f"{type(block).__name__} captures through its own hooks"
        if self.positions is not None:
            return "KFAC.mask() is active"
        if not compiled_capture.available():
            return f"torch {torch.__version__} has no custom ops with effects"
        return None

    @torch.compiler.disable
    def _warn_untraced(self, block: KroneckerBlock, reason: str) -> None:
        """Once: ``block`` keeps its tensor hook under compile, for ``reason`` (run eagerly: a graph break)."""
        self._warned_untraced = True
        warn_user(
            f"K-FAC layer '{block.name}' records through a tensor hook under torch.compile ({reason}): a graph "
            "break at each such layer (fullgraph=True fails); its statistics are as in eager mode "
            "(docs/design.md §4, 'Compiled models')"
        )

    def _new_tapped(self, block: KroneckerBlock, layer_input: Any, param: Tensor, call: ModelCall,
                    positions: RealPositions | None = None) -> Tapped:
        """One forward call's :class:`Tapped` for ``block``, whose module uses ``param`` now, from
        model call ``call`` (:attr:`call` then) with real ``positions`` (None: all)."""
        # e.g. FSDP2 has put the sharded parameter back after the forward; its unsharded copy is back in the backward
        node = None if self._resharded(param) else self._node_of(block, param)
        return Tapped(block, layer_input, param, node, call, positions)

    def record_traced(self, block: KroneckerBlock, layer_input: Any, grad_output: Tensor) -> None:
        """:meth:`record` for an output tapped in a compiled forward (``compiled_capture``), called in
        the backward pass. The forward kept no :class:`Tapped`: a pair held for a backward that
        kept its graph is found again by its layer input (the same tensor, saved for this
        backward), so later backward passes of that forward add to it as in eager mode. (A new
        forward of the very same input tensor, backpropagated while the earlier forward's pair is
        still held, is taken for that forward: the one case where compiled and eager differ.)"""
        task = current_graph_task()
        tensor = layer_input if isinstance(layer_input, Tensor) else layer_input[-1]
        for tapped in self._held:
            if tapped.block is block and tapped.latest != task and same_tensor(tapped.layer_input, tensor):
                break
        else:
            param = self._recorded_parameter(block)
            if param is None:
                return
            tapped = self._new_tapped(block, layer_input, param, ModelCall(self.model_calls))
        self.record(tapped, grad_output)

    def _recorded_parameter(self, block: KroneckerBlock) -> Tensor | None:
        """The parameter of ``block`` whose ``.grad`` decides whether a backward records (the one
        its module uses now: FSDP2's unsharded copy, Apex's model weight): the weight; None when it
        does not require grad (a frozen layer, or BitFit's trained biases: the block preconditions
        through the weight's gradient, so statistics without it would be work for nothing)."""
        weight = block.weight_and_bias(block.module)[0]
        return weight if weight.requires_grad else None

    def _node_of(self, block: KroneckerBlock, param: Tensor, stale: Any = None) -> Any:
        """``param``'s ``AccumulateGrad`` node, fetched once per parameter object of ``block`` and
        again when the node held is ``stale`` (see :meth:`_writes_gradient`). A parameter object
        other than the one the block was built with is warned about once (:meth:`_warn_replaced`)."""
        cached = self._nodes.get(block)
        if cached is None or cached[0] is not param or cached[1] is stale:
            if param is not block.module_weight and not self._resharded(block.module_weight):
                self._warn_replaced(block)
            cached = self._nodes[block] = (param, gradient_node(param))
        return cached[1]

    def _writes_gradient(self, tapped: Tapped) -> bool:
        """Whether the running backward writes ``tapped``'s parameter's ``.grad``; its node is taken
        here when the forward's parameter was a ``DTensor`` (FSDP2 swaps its unsharded copy back in
        for the backward). When the node held is not run, the parameter's node is fetched again: a
        dtype or device conversion (``model.double()``, ``.half()`` then ``.float()``, ``.to(device)``)
        or a swap (``torch.utils.swap_tensors``, ``load_state_dict`` under
        ``torch.__future__.set_swap_module_params_on_conversion(True)``) gives the same parameter
        object a new node (so side passes, and only they, pay for a fetch)."""
        if tapped.node is None:
            param = self._recorded_parameter(tapped.block)
            if param is None:
                return False
            tapped.param, tapped.node = param, self._node_of(tapped.block, param)
        if writes_gradient(tapped.node):
            return True
        if not tapped.param.requires_grad:  # frozen since the forward: it has no node to fetch
            return False
        node = self._node_of(tapped.block, tapped.param, stale=tapped.node)
        if node is tapped.node:
            return False
        tapped.node = node
        return writes_gradient(node)

    def _warn_replaced(self, block: KroneckerBlock) -> None:
        """Once per block: its module's weight is not the parameter the block was built with."""
        if block.name in self._warned_replaced:
            return
        self._warned_replaced.add(block.name)
        warn_user(
            f"K-FAC layer '{block.name}': the module's weight is no longer the parameter KFAC was built with "
            "(replaced by load_state_dict(assign=True), an assignment, or a conversion under "
            "torch.__future__.set_overwrite_module_params_on_conversion(True)); like any torch optimizer, KFAC "
            "steps the parameters it was given, so this layer is neither stepped nor preconditioned: build KFAC "
            "after replacing parameters, or change them in place (load_state_dict without assign=True, or under "
            "torch.__future__.set_swap_module_params_on_conversion(True))",
            RuntimeWarning,
        )

    def record(self, tapped: Tapped, grad_output: Tensor) -> None:
        """Hand one forward's (input, output-gradient) pair to its block, if this backward pass
        writes the block's ``.grad`` (see the module docstring); while the graph is kept for
        another backward, hold the summed output-gradient instead (:meth:`flush`)."""
        self.arrivals += 1
        if not self._recording:
            return
        if torch.is_grad_enabled():  # a create_graph=True backward: see the module docstring
            self.graph_backward_skipped = True
            return
        if self._every_backward and not self._writes_gradient(tapped):
            return  # a side pass: torch.autograd.grad, an input gradient
        block, task = tapped.block, current_graph_task()
        fed_in = self._fed.get(block)
        if fed_in is not None and fed_in != task and not tapped.gradient_kept():
            self._drop_pending(block)  # an earlier backward's gradient was discarded (module.zero_grad())
        total = grad_output if tapped.summed is None else tapped.summed + grad_output
        if self._every_backward and keeps_graph():  # another backward of this forward may add to it
            if tapped.summed is None:
                tapped.task = task
                self._held[tapped] = None
            tapped.summed, tapped.latest = total, task
            return
        replayed = None
        if tapped.summed is not None:
            replayed = tapped.task
            tapped.summed = None
            del self._held[tapped]
        self._hand_on(tapped, total, replayed)

    def flush(self) -> None:
        """Hand on the pairs held for backward passes that kept their graph (at the step)."""
        held, self._held = self._held, {}
        for tapped in held:
            total, tapped.summed = tapped.summed, None
            if total is not None:
                self._hand_on(tapped, total, tapped.task)

    def drop_without_gradient(self) -> None:
        """At the step, before the fold: drop the pending statistics of blocks that recorded but
        whose gradient was discarded since (``module.zero_grad()`` after the backward)."""
        for block in [block for block in self._fed if not block.has_gradient()]:
            self._drop_pending(block)

    def forget(self) -> None:
        """The pending statistics were folded or dropped: forget the held pairs and what was recorded."""
        self._held.clear()
        self._fed.clear()
        self.recorded = 0

    def _drop_pending(self, block: KroneckerBlock) -> None:
        """Forget ``block``'s pending statistics (after the worker's work on them, in order)."""
        self._fed.pop(block, None)
        if self._worker is None or self._in_line():
            if self._worker is not None:
                self._worker.wait()
            block.discard_pending()
        else:
            self._worker.submit(block.discard_pending)

    def _hand_on(self, tapped: Tapped, grad_output: Tensor, task: int | None) -> None:
        """Hand ``tapped``'s pair to ``accumulate`` (or the worker), as recorded in graph task
        ``task`` (None: the running one)."""
        block, layer_input, call, positions = tapped.block, tapped.layer_input, tapped.call, tapped.positions
        self.recorded += 1
        self._fed[block] = current_graph_task() if task is None else task
        if self._worker is None or self._in_line():
            if self._worker is not None:
                self._worker.wait()  # its earlier work (e.g. a fold) comes first
            with in_graph_task(task) if task is not None else contextlib.nullcontext(), \
                    recording_pair(call.index, positions, call.samples, call.rows):
                self._accumulate(block, layer_input, grad_output)
            return
        tensors = tensors_of(layer_input, grad_output)
        versions = [t._version for t in tensors]
        task = torch._C._current_graph_task_id() if task is None else task
        self._worker.submit(self._accumulate_later, block, layer_input, grad_output, task, versions, call, positions)

    def _accumulate_later(
        self, block: KroneckerBlock, layer_input: Any, grad_output: Tensor, task: int, versions: list[int],
        call: ModelCall, positions: RealPositions | None,
    ) -> None:
        """On the worker: hand the pair on as :meth:`record` would have, unless it changed since."""
        if [t._version for t in tensors_of(layer_input, grad_output)] != versions:
            self.overwritten.add(block.name)
            return
        with in_graph_task(task), recording_pair(call.index, positions, call.samples, call.rows):
            self._accumulate(block, layer_input, grad_output)

    @contextlib.contextmanager
    def recording_outputs(self) -> Iterator[list[Tensor]]:
        """Record the output-gradients of the backward passes run inside (for ``every_backward=False``),
        yielding the hooked outputs of the forward passes since the last such pass: a pass that
        differentiates with respect to them runs exactly the backward their hooks need (it does not
        depend on how the parameters reach the graph, e.g. FSDP2's unsharded copies)."""
        outputs, self._tapped = self._tapped, []
        self._recording = True
        try:
            yield outputs
        finally:
            self._recording = self._every_backward

    def hold(self, handles: list[RemovableHandle]) -> None:
        """Hooks of another part (the one-time weight-use check) that live no longer than this
        capture's: removed with them (:meth:`remove`, a take-over by a new capture, collection)."""
        self._handles.extend(handles)

    def remove(self) -> None:
        """Remove every hook from the model and from deep copies of it (idempotent)."""
        self._finalizer()
        self.armed = False
        self._call_outputs = set()
