"""Hooks that capture layer inputs and output-gradients into the blocks' pending statistics.

Owns: the forward hooks on supported modules, their handles, and whether they are armed.
Must not know: factor math (blocks do it), step counting or schedules (the optimizer arms us).

When armed, a module in training mode called with grad enabled and an output that requires grad
gets a tensor hook on that output; when the output-gradient arrives, the (input, output-grad)
pair is handed to the block. Nothing is computed in the forward pass, so:
  - a forward whose backward never runs costs nothing;
  - ``torch.utils.checkpoint`` does not double count: the reentrant variant's first forward runs
    without grad (skipped), and the non-reentrant variant's recomputed output receives no
    gradient of its own (its hook never fires);
  - an in-place op on the output (``ReLU(inplace=True)``) is safe: a tensor hook registered before
    the in-place op sees the gradient of the layer's own output.
``register_full_backward_hook`` is deliberately not used (it breaks on in-place ops after the layer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from kfac_optim.layers import KroneckerBlock

logger = logging.getLogger(__name__)

Accumulate = Callable[[KroneckerBlock, Tensor, Tensor], None]


def accumulate_plainly(block: KroneckerBlock, inputs: Tensor, grad_output: Tensor) -> None:
    """The default hand-off: ``block.accumulate(inputs, grad_output)``."""
    block.accumulate(inputs, grad_output)


class StatisticsCapture:
    """Forward hooks on every block's module; statistics flow only while ``armed`` is True.

    ``accumulate(block, input, output_grad)`` receives each captured pair (the optimizer passes
    one that handles loss scaling, see ``precision``).
    """

    def __init__(self, blocks: Iterable[KroneckerBlock], accumulate: Accumulate = accumulate_plainly) -> None:
        self.armed = False
        self._accumulate = accumulate
        self._handles: list[RemovableHandle] = [
            block.module.register_forward_hook(self._forward_hook(block)) for block in blocks
        ]

    def _forward_hook(self, block: KroneckerBlock):
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            if not (self.armed and module.training and torch.is_grad_enabled()):
                return
            if not isinstance(output, Tensor) or not output.requires_grad:
                return
            layer_input = inputs[0].detach()
            accumulate = self._accumulate
            output.register_hook(lambda grad_output: accumulate(block, layer_input, grad_output))

        return hook

    def remove(self) -> None:
        """Remove every hook from the model (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.armed = False
