"""K-FAC blocks for ``nn.MultiheadAttention``: the input projections and ``out_proj``.

``nn.MultiheadAttention`` applies its projections inside ``F.multi_head_attention_forward`` with
its parameters, never calling ``out_proj`` as a module, so forward hooks see none of the
projections' inputs or outputs. While a forward of the module records statistics, a
``TorchFunctionMode`` (pushed by a forward pre-hook, popped by a forward hook that always runs)
takes that one call over: it applies the projections itself with the same parameters, registers
gradient hooks on their outputs, and calls ``F.multi_head_attention_forward`` with identity
projections (exact: multiplying by ``I`` and adding no bias changes no value), so masks, dropout
(same RNG draws), ``bias_k``/``bias_v``, ``add_zero_attn``, ``batch_first`` and cross-attention
behave as the module's own forward. Cost: four extra ``E x E`` matmuls per recorded forward.

Blocks (conventions of ``layers.factor``; rows are sequence positions, N the batch):
- packed ``in_proj_weight (3E, E)`` (``kdim = vdim = E``): one block of three Kronecker pairs
  (q, k, v), ``A: (3, E [+1], E [+1])`` from the query, key and value rows (each with its own row
  count), ``G: (3, E, E)`` from the projections' output-gradients; ``in_proj_bias`` rides along;
- separate ``q/k/v_proj_weight`` (``kdim`` or ``vdim`` != E): one block each, without bias
  (``in_proj_bias`` then takes the SGD path: it spans the three);
- ``out_proj``: a Linear block fed the attention output before ``out_proj``.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from kfac_optim.layers.base import Capture, KroneckerBlock
from kfac_optim.layers.factor import output_gram_scale
from kfac_optim.layers.hooks import CopiedAsInert, current_mask
from kfac_optim.layers.linear import LinearBlock
from kfac_optim.layers.positions import RealPositions

_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_PROJECTIONS = ("q", "k", "v")


def _batch_size(x: Tensor) -> int:
    """N of an input in the functional's layout ``(L, N, E)`` (``(L, E)`` unbatched)."""
    return x.shape[1] if x.dim() == 3 else 1


def _sequence_first(tensor: Tensor) -> Tensor | None:
    """``(N, L, E)`` from the functional's ``(L, N, E)`` (None when unbatched)."""
    return tensor.transpose(0, 1) if tensor.dim() == 3 else None


class _FedByTheAttentionTap(LinearBlock):
    """A block whose statistics come from its ``nn.MultiheadAttention``'s tap, in the functional's
    ``(L, N, ·)`` layout with N the batch (``attention`` is set by :meth:`InProjectionBlock.create`)."""

    attention: _AttentionCapture | None = None

    def install_capture(self, capture: Capture) -> list[RemovableHandle] | None:
        return self.attention.install(capture, self)

    per_sample = staticmethod(_sequence_first)

    def sample_count(self, inputs: Tensor) -> int:
        return _batch_size(inputs)

    @property
    def counts_own_batch(self) -> bool:
        """Sequence-first attention counts its real batch (the model's input's dim 0 is the length)."""
        return not self.attention.module.batch_first

    def mask_of(self, layer_input: Any, positions: RealPositions) -> RealPositions | None:
        """The mask ``(N, L)`` (batch first, as the user's) over an input in the functional's layout
        ``(L, N, E)``, transposed to it; None unbatched. A key or value of another length (cross
        attention) is recorded whole with a one-time warning."""
        x = layer_input[1] if isinstance(layer_input, tuple) else layer_input
        if x.dim() != 3:
            return None
        fitted = positions.fit((x.shape[1], x.shape[0]))
        if fitted is None:
            self.warn_unmasked(f"its input's (batch, length) {(x.shape[1], x.shape[0])} is not the mask's shape "
                               f"{tuple(positions.mask.shape)}")
            return None
        return RealPositions(fitted.mask.T, fitted.count)


class InProjectionBlock(_FedByTheAttentionTap):
    """The packed ``in_proj_weight``: three Kronecker pairs (q, k, v), batched as groups."""

    groups = 3
    module: nn.MultiheadAttention

    @classmethod
    def unsupported_reason(cls, module: nn.Module) -> str | None:
        return None

    @classmethod
    def weight_and_bias(cls, module: nn.Module) -> tuple[nn.Parameter, nn.Parameter | None]:
        return module.in_proj_weight, module.in_proj_bias

    @classmethod
    def create(
        cls, name: str, module: nn.Module, trainable: set[Tensor], claimed: set[Tensor], factor_dtype: torch.dtype
    ) -> list[KroneckerBlock]:
        """Blocks of the input projections (packed or separate) and ``out_proj``; one capture for all."""
        def child(suffix: str) -> str:
            return f"{name}.{suffix}" if name else suffix

        blocks: list[KroneckerBlock] = []
        if module._qkv_same_embed_dim:
            blocks += super().create(child("in_proj"), module, trainable, claimed, factor_dtype)
        else:
            for index, letter in enumerate(_PROJECTIONS):
                weight = getattr(module, f"{letter}_proj_weight")
                if weight in trainable and weight not in claimed:
                    claimed.add(weight)
                    blocks.append(ProjectionBlock(child(f"{letter}_proj"), module, index, factor_dtype))
        blocks += OutProjectionBlock.create(child("out_proj"), module.out_proj, trainable, claimed, factor_dtype)
        if blocks:
            _AttentionCapture(module, blocks)
        return blocks

    def __init__(self, name: str, module: nn.Module, include_bias: bool, factor_dtype: torch.dtype) -> None:
        super().__init__(name, module, include_bias, factor_dtype)
        self._group_rows = [0] * self.groups

    def accumulate(self, inputs: tuple[int, Tensor], grad_output: Tensor) -> None:
        """``inputs``: ``(j, x)``, projection ``j``'s input ``x``; ``grad_output`` its output-gradient."""
        index, x = inputs
        dtype, positions = self.A.pending.dtype, current_mask()
        with torch.autocast(x.device.type, enabled=False):
            if positions is None:
                rows, g, real = self.input_rows(x).to(dtype), self.output_grad_rows(grad_output).to(dtype), None
            elif self.reduce:  # per sample: the mean over its real positions, the summed gradient
                sums, uses = self.use_sums(x.to(dtype), positions)
                rows, g, real = sums / uses.clamp(min=1), self.use_sums(grad_output.to(dtype), positions)[0], None
            else:
                rows, g, real = self.real_rows(x.to(dtype), grad_output.to(dtype), positions)
            self.A.add_gram(rows, append_ones=self.bias is not None, group=index, count=real)
            self.G.add_gram(g, group=index)
        self._group_rows[index] += rows.shape[0] if real is None else real
        self.count_samples(self.sample_count(x))  # once per backward for the three projections

    def discard_pending(self) -> None:
        super().discard_pending()
        self._group_rows = [0] * self.groups

    def fold(self, decay: float, loss_reduction: str, grad_scale: float | Tensor = 1.0) -> None:
        """As :meth:`KroneckerBlock.fold`, with each pair's ``A`` divided by its own row count."""
        if self.pending_samples == 0:
            return
        rows = torch.tensor([1.0 / max(r, 1) for r in self._group_rows], dtype=self.A.pending.dtype)
        self.A.fold(rows.to(self.A.pending.device).view(-1, 1, 1), decay)
        self.G.fold(output_gram_scale(self.pending_samples, loss_reduction, grad_scale), decay)
        self.forget_samples()
        self._group_rows = [0] * self.groups


class ProjectionBlock(_FedByTheAttentionTap):
    """One of ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` (no bias: ``in_proj_bias`` spans all three)."""

    module: nn.MultiheadAttention

    def __init__(self, name: str, module: nn.Module, index: int, factor_dtype: torch.dtype) -> None:
        self.index = index
        super().__init__(name, module, False, factor_dtype)

    def weight_and_bias(self, module: nn.Module) -> tuple[nn.Parameter, nn.Parameter | None]:  # type: ignore[override]
        return getattr(module, f"{_PROJECTIONS[self.index]}_proj_weight"), None


class OutProjectionBlock(_FedByTheAttentionTap):
    """``out_proj``, fed the attention output before it (``(L, N, E)``)."""


def sequence_first_note(blocks: list[KroneckerBlock]) -> str | None:
    """A warning for a model whose sample counts may disagree between its blocks (docs/numerics.md).

    Attention blocks count the real batch N whatever ``batch_first``; every other block counts dim
    0 of its layer's input, which in a sequence-first model is the sequence length L. The note is
    for models with a sequence-first ``nn.MultiheadAttention`` and some other block; None otherwise.
    """
    attention = (InProjectionBlock, ProjectionBlock, OutProjectionBlock)
    sequence_first = sorted({
        block.name.rsplit(".", 1)[0] if "." in block.name else "<root>"
        for block in blocks
        if isinstance(block, attention) and not block.attention.module.batch_first
    })
    others = [block.name for block in blocks if not isinstance(block, attention)]
    if not sequence_first or not others:
        return None
    return (
        f"sequence-first attention (batch_first=False: {', '.join(sequence_first)}): its blocks count the batch "
        "as the samples N, while every other block (Linear, Embedding, ...) counts dim 0 of its input; those fed "
        "(L, N, ...) count N = L, which scales their G by L/N (mean loss; N/L for a sum) against attention's: "
        "their damping acts as damping·N/L, and their step as N/L times, those of the batch-first model "
        "(docs/numerics.md). batch_first=True makes every block count N"
    )


class _AttentionCapture:
    """One module's interception of ``F.multi_head_attention_forward``, shared by its blocks."""

    def __init__(self, module: nn.MultiheadAttention, blocks: list[KroneckerBlock]) -> None:
        self.module = module
        self.in_blocks: dict[int, KroneckerBlock] = {}
        self.packed: InProjectionBlock | None = None
        self.out_block: OutProjectionBlock | None = None
        for block in blocks:
            block.attention = self
            if isinstance(block, InProjectionBlock):
                self.packed = block
            elif isinstance(block, ProjectionBlock):
                self.in_blocks[block.index] = block
            else:
                self.out_block = block
        self.installed = False
        self.taps: list[_Tap] = []

    def install(self, capture: Capture, block: KroneckerBlock) -> list[RemovableHandle]:
        """The module's hooks, once (for the first of its blocks; the others get none)."""
        if self.installed:
            return []
        self.installed = True
        push, pop = _PushTap(self, capture), _PopTap(self)
        return [
            self.module.register_forward_pre_hook(push),
            self.module.register_forward_hook(pop, always_call=True),
        ]


class _PushTap(CopiedAsInert):
    """Forward pre-hook: push a :class:`_Tap` when this forward of the module records statistics."""

    def __init__(self, attention: _AttentionCapture, capture: Capture) -> None:
        self.attention = attention
        self.capture = weakref.ref(capture)

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        capture = self.capture()
        if capture is not None and module is self.attention.module and capture.should_capture(module):
            mode = _Tap(self.attention, capture)
            mode.__enter__()
            self.attention.taps.append(mode)


class _PopTap(CopiedAsInert):
    """Forward hook (always called, also when the forward raised): pop the tap pushed for it."""

    def __init__(self, attention: _AttentionCapture) -> None:
        self.attention = attention

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if module is self.attention.module and self.attention.taps:
            self.attention.taps.pop().__exit__(None, None, None)


class _Tap(TorchFunctionMode):
    """Takes over this module's ``F.multi_head_attention_forward`` call (see the module docstring)."""

    def __init__(self, attention: _AttentionCapture, capture: Capture) -> None:
        super().__init__()
        self.attention = attention
        self.capture = weakref.ref(capture)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's protocol)
        kwargs = kwargs or {}
        if func is not F.multi_head_attention_forward:
            return func(*args, **kwargs)
        call = _MHA_SIGNATURE.bind(*args, **kwargs)
        call.apply_defaults()
        p = call.arguments
        module = self.attention.module
        if p["out_proj_weight"] is not module.out_proj.weight or p["query"].shape[-1] != p["embed_dim_to_check"]:
            return func(*args, **kwargs)  # not this module's call, or one torch rejects: its own error
        return self._tapped(func, p)

    def _tap(self, block: KroneckerBlock | None, layer_input: Any, output: Tensor) -> None:
        capture = self.capture()
        if block is None or capture is None or not output.requires_grad:
            return
        capture.tap(block, layer_input, output)

    def _tapped(self, func, p: dict[str, Any]) -> tuple[Tensor, Tensor | None]:  # noqa: ANN001
        attention = self.attention
        embed_dim = p["embed_dim_to_check"]
        if p["use_separate_proj_weight"]:
            weights = [p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]]
        else:
            weights = list(p["in_proj_weight"].chunk(3))
        biases = [None] * 3 if p["in_proj_bias"] is None else list(p["in_proj_bias"].chunk(3))
        inputs = [p["query"], p["key"], p["value"]]
        projected = []
        for index, (x, weight, bias) in enumerate(zip(inputs, weights, biases, strict=True)):
            y = F.linear(x, weight, bias)
            if attention.packed is not None:
                self._tap(attention.packed, (index, x.detach()), y)
            else:
                self._tap(attention.in_blocks.get(index), x.detach(), y)
            projected.append(y)
        identity = torch.eye(embed_dim, dtype=projected[0].dtype, device=projected[0].device)
        p.update(
            query=projected[0], key=projected[1], value=projected[2],
            in_proj_weight=None, in_proj_bias=None, use_separate_proj_weight=True,
            q_proj_weight=identity, k_proj_weight=identity, v_proj_weight=identity,
            out_proj_weight=identity, out_proj_bias=None,
        )
        attended, weights_out = func(**p)
        output = F.linear(attended, attention.module.out_proj.weight, attention.module.out_proj.bias)
        self._tap(attention.out_block, attended.detach(), output)
        return output, weights_out
