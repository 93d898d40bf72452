"""A one-time check that a preconditioned weight is used in the graph only by its module's calls.

Owns: the check and its one warning. A block's statistics are those of its module's calls
(``KroneckerBlock.captured_modules``); a weight that the model also uses another way (a head
``h @ emb.weight.T`` tying an embedding's weight functionally, ``F.linear(x, layer.weight)`` beside
``layer(x)``) gets gradient from uses the statistics do not hold, so its Fisher is not the block's
Kronecker product. Such a use cannot be seen from the module; it is seen in the autograd graph:
every use of a leaf is an edge into its ``AccumulateGrad`` node.
Must not know: the capture, factors, the step.

How: at the model's first forward with grad enabled, forward pre-hooks count the calls of the
blocks' modules, and after it the graph is walked back once from the model's outputs, counting
the edges into each block weight's ``AccumulateGrad`` node. More edges than calls: the weight is
used outside its module's calls, warned once naming the layers. Then every hook is removed: no cost
after the first forward. Uses outside the model's forward (in the loss) are not seen; a module
whose weight reaches the graph through another tensor (a cast cached by autocast, an FSDP2
all-gather, a compiled graph) shows as many edges as calls or fewer and is not warned about.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfac_optim.diagnostics import warn_user
from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.hooks import CopiedAsInert


def output_tensors(output: Any) -> list[Tensor]:
    """The tensors in a model's output: a tensor, or tensors nested in sequences and mappings
    (a Hugging Face ``ModelOutput`` is a mapping)."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, Mapping):
        return [t for value in output.values() for t in output_tensors(value)]
    if isinstance(output, (list, tuple)):
        return [t for value in output for t in output_tensors(value)]
    return []


def edges_into(outputs: Sequence[Tensor], leaves: set[Tensor]) -> dict[Tensor, int]:
    """For each tensor of ``leaves`` (leaves that require grad), how many edges of the graph that
    produced ``outputs`` lead into its ``AccumulateGrad`` node: one per use of the leaf."""
    counts: dict[Tensor, int] = {}
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen = set(stack)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            leaf = getattr(child, "variable", None)  # an AccumulateGrad node's leaf
            if leaf is not None and leaf in leaves:
                counts[leaf] = counts.get(leaf, 0) + 1
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return counts


class _CallCount(CopiedAsInert):
    def __init__(self, check: WeightUseCheck, block: KroneckerBlock) -> None:
        self.check = weakref.ref(check)
        self.block = block

    def __call__(self, module: nn.Module, args: Any) -> None:
        check = self.check()
        if check is not None and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            check.calls[self.block] = check.calls.get(self.block, 0) + 1


class _ModelCall(CopiedAsInert):
    def __init__(self, check: WeightUseCheck, before: bool) -> None:
        self.check = weakref.ref(check)
        self.before = before

    def __call__(self, module: nn.Module, args: Any, output: Any = None) -> None:
        check = self.check()
        if check is None or torch.compiler.is_compiling():  # a traced model: the check never runs
            return
        if self.before:
            check.calls.clear()
            check.expect_output(module)
        else:
            check.after_forward(output)


class WeightUseCheck:
    """The check on ``model`` for ``blocks`` (see the module docstring); it holds its hooks until
    the first forward with grad enabled whose outputs require grad, or until :meth:`remove`."""

    def __init__(self, model: nn.Module, blocks: Sequence[KroneckerBlock]) -> None:
        self.calls: dict[KroneckerBlock, int] = {}
        self._blocks = [block for block in blocks if block.sgd_reason is None]
        self._handles: list[RemovableHandle] = []
        if not self._blocks:
            return
        self._handles = [model.register_forward_pre_hook(_ModelCall(self, before=True))]
        for block in self._blocks:
            for module in block.captured_modules():
                self._handles.append(module.register_forward_pre_hook(_CallCount(self, block)))
        self._output_hook: RemovableHandle | None = None
        weakref.finalize(self, _remove_all, self._handles)

    @property
    def handles(self) -> list[RemovableHandle]:
        """The check's hooks (the capture removes them with its own: ``StatisticsCapture.hold``)."""
        return self._handles

    def expect_output(self, model: nn.Module) -> None:
        """Hook the output of the model call now starting, once: between calls the model holds no
        forward hook of the check's (only its pre-hooks)."""
        if self._output_hook is None:
            self._output_hook = model.register_forward_hook(_ModelCall(self, before=False))
            self._handles.append(self._output_hook)

    def after_forward(self, output: Any) -> None:
        """Compare, once, the edges into each weight's node with its module's calls; then remove the hooks."""
        if self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook = None
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        outputs = [t for t in output_tensors(output) if t.grad_fn is not None]
        if not outputs:
            return
        weights = {block.module_weight: block for block in self._blocks if block.module_weight.requires_grad}
        edges = edges_into(outputs, set(weights))
        outside = [f"'{block.name}' ({type(block.module).__name__}: {edges[weight]} uses in the graph, "
                   f"{self.calls[block]} module call(s))"
                   for weight, block in weights.items()
                   if self.calls.get(block, 0) and edges.get(weight, 0) > self.calls[block]]
        self.remove()
        if outside:
            warn_user(
                "K-FAC layer weight(s) used outside their module's calls: " + "; ".join(outside) + ". Their "
                "statistics hold the module's calls only (e.g. h @ embedding.weight.T, or F.linear(x, layer.weight) "
                "beside layer(x)), so those uses are preconditioned with factors that do not describe them; call "
                "the module (a tied head as an nn.Linear sharing the weight is supported), or skip the layer "
                "(CurvatureConfig(skip_layers=...))"
            )

    def remove(self) -> None:
        _remove_all(self._handles)
        self.calls.clear()


def _remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()
