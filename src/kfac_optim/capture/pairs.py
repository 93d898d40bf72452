"""One forward's tapped output of a block, and the (layer input, output-gradient) pair it becomes.

Owns: :class:`Tapped` (what the capture keeps of a forward until its output-gradient arrives, and
while a kept graph sums more of them), and the pair's tensors and identity (:func:`tensors_of`,
:func:`same_tensor`).
Must not know: hooks, arming, the worker or which backward records (``capture.py`` decides).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from kfac_optim.capture.calls import ModelCall
from kfac_optim.layers.base import KroneckerBlock
from kfac_optim.layers.positions import RealPositions


class Tapped:
    """One forward call's tapped output of a block: its input, the parameter whose ``.grad`` its
    backward writes (and that parameter's ``AccumulateGrad`` node), the model call it came from
    (its samples: ``capture_calls.ModelCall``) and the real positions of its forward (``KFAC.mask``; None: all), and,
    while its graph is kept for another backward, the sum of its output-gradients so far, the graph task that brought
    the first and the one that brought the latest."""

    __slots__ = ("block", "call", "latest", "layer_input", "node", "param", "positions", "summed", "task")

    def __init__(self, block: KroneckerBlock, layer_input: Any, param: Tensor, node: Any, call: ModelCall,
                 positions: RealPositions | None) -> None:
        self.block = block
        self.layer_input = layer_input
        self.param = param
        self.node = node
        self.call = call
        self.positions = positions
        self.summed: Tensor | None = None
        self.task = -1
        self.latest = -1

    def gradient_kept(self) -> bool:
        """Whether the gradient the block's pending statistics belong to still exists (``.grad`` of
        the parameter the forward used, e.g. FSDP2's unsharded copy, or of the block's own)."""
        return self.param.grad is not None or self.block.has_gradient()


def same_tensor(layer_input: Any, tensor: Tensor) -> bool:
    """Whether ``layer_input`` (a tensor, or a tuple ending in one) holds ``tensor``'s data: same
    memory, shape and strides (a held input is alive, so its memory is not another tensor's)."""
    held = layer_input if isinstance(layer_input, Tensor) else layer_input[-1]
    return held.data_ptr() == tensor.data_ptr() and held.shape == tensor.shape and held.stride() == tensor.stride()


def tensors_of(layer_input: Any, grad_output: Tensor) -> list[Tensor]:
    """The tensors of a captured pair (a block's input may be a tuple holding tensors)."""
    parts = layer_input if isinstance(layer_input, tuple) else (layer_input,)
    return [t for t in (*parts, grad_output) if isinstance(t, Tensor)]
