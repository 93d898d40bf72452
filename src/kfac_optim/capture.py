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

With ``every_backward=False`` (the sampled Fisher) output-gradients are recorded only inside
:meth:`StatisticsCapture.recording`, the optimizer's extra backward pass at sampled targets; the
training loss's own backward then passes the hooks without recording.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

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
    one that handles loss scaling, see ``precision``). ``every_backward``: record the
    output-gradients of every backward pass (True) or only those inside :meth:`recording`.
    """

    def __init__(
        self,
        blocks: Iterable[KroneckerBlock],
        accumulate: Accumulate = accumulate_plainly,
        every_backward: bool = True,
    ) -> None:
        self.armed = False
        self._accumulate = accumulate
        self._recording = every_backward
        self._every_backward = every_backward
        self._handles: list[RemovableHandle] = []
        for block in blocks:
            own = block.install_capture(self)
            if own is None:
                own = [block.module.register_forward_hook(self._forward_hook(block), with_kwargs=True)]
            self._handles.extend(own)

    def should_capture(self, module: nn.Module) -> bool:
        """Whether a forward of ``module`` now records statistics: armed, training, grad enabled."""
        return self.armed and module.training and torch.is_grad_enabled()

    def deliver(self, block: KroneckerBlock, layer_input: Any, grad_output: Tensor) -> None:
        """Hand one captured pair to the accumulate callback, when recording output-gradients."""
        if self._recording:
            self._accumulate(block, layer_input, grad_output)

    def _forward_hook(self, block: KroneckerBlock):
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Tensor) -> None:
            if not self.should_capture(module):
                return
            if not isinstance(output, Tensor) or not output.requires_grad:
                return
            layer_input = block.layer_input(args, kwargs).detach()
            output.register_hook(lambda grad_output: self.deliver(block, layer_input, grad_output))

        return hook

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the output-gradients of the backward passes run inside (for ``every_backward=False``)."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = self._every_backward

    def remove(self) -> None:
        """Remove every hook from the model (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.armed = False
