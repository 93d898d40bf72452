"""O1: patch torch functions to cast their floating arguments (follows ``apex/amp/amp.py``).

Lists from ``apex/amp/lists/{functional,torch,tensor}_overrides.py``; wrappers from
``apex/amp/wrap.py``. A patched function casts only while ``_amp_state.handle.is_active()``:
FP16 functions cast every floating argument (``self`` included, whatever its dtype, fp64 too) to
fp16, FP32 functions to fp32; in-place methods of the FP16/CASTS lists cast their arguments to the
dtype of ``self``; in-place FP32 functions refuse fp16 tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ._amp_state import _amp_state
from .handle import AmpHandle

_FUNCTIONAL_FP16 = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                    "conv_transpose3d", "conv_tbc", "linear"]
_FUNCTIONAL_FP32 = [
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "layer_norm",
    "group_norm", "local_response_norm", "normalize", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss", "kl_div", "l1_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss",
    "multi_margin_loss", "nll_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss",
    "soft_margin_loss", "triplet_margin_loss",
]
_TORCH_FP16 = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
               "conv_transpose3d", "conv_tbc", "prelu", "addmm", "addmv", "addr", "matmul", "mm",
               "mv", "addbmm", "baddbmm", "bmm"]
_TORCH_FP32 = ["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2",
               "reciprocal", "rsqrt", "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "mean",
               "norm", "prod", "std", "sum", "var", "renorm"]
_TORCH_CASTS = ["addcdiv", "addcmul", "atan2", "cross", "add", "div", "mul", "eq", "equal", "ge",
                "gt", "le", "lt", "ne"]
# Tensor methods: Apex adds every torch-list name that Tensor also has; "cpu" (a CUDA->host cast
# in Apex) is left out on CPU.
_TENSOR_FP16 = ["__matmul__", *(n for n in _TORCH_FP16 if hasattr(torch.Tensor, n))]
_TENSOR_FP32 = ["__ipow__", "__pow__", "__rpow__",
                *(n for n in _TORCH_FP32 if hasattr(torch.Tensor, n))]
_TENSOR_CASTS = [n for n in _TORCH_CASTS if hasattr(torch.Tensor, n)]



def maybe_half(x: torch.Tensor) -> torch.Tensor:
    """Cast to fp16 unless already fp16."""
    return x if x.dtype == torch.float16 else x.half()


def maybe_float(x: torch.Tensor) -> torch.Tensor:
    """Cast to fp32 unless already fp32."""
    return x if x.dtype == torch.float32 else x.float()


def _cast(cast_fn: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        if all(isinstance(y, torch.Tensor) and y.is_floating_point() for y in x):
            return type(x)(cast_fn(y) for y in x)
        return x
    return cast_fn(x) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


Wrapper = Callable[[AmpHandle, Callable[..., Any]], Callable[..., Any]]


def _cast_args(cast_fn: Callable[[torch.Tensor], torch.Tensor]) -> Wrapper:
    """Apex ``make_cast_wrapper``: cast every floating argument while the handle is active."""

    def make(handle: AmpHandle, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not handle.is_active():
                return orig(*args, **kwargs)
            new_args = [_cast(cast_fn, a) for a in args]
            return orig(*new_args, **{k: _cast(cast_fn, v) for k, v in kwargs.items()})

        return wrapper

    return make


def _promote_match_arg0(handle: AmpHandle, orig: Callable[..., Any]) -> Callable[..., Any]:
    """In-place methods: cast the other arguments to the dtype of ``self`` (fp16 or fp32)."""

    @functools.wraps(orig)
    def wrapper(arg0: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not handle.is_active() or arg0.dtype not in (torch.float16, torch.float32):
            return orig(arg0, *args, **kwargs)
        cast_fn = maybe_half if arg0.dtype == torch.float16 else maybe_float
        new_args = [_cast(cast_fn, a) for a in args]
        return orig(arg0, *new_args, **{k: _cast(cast_fn, v) for k, v in kwargs.items()})

    return wrapper


def _err_if_any_half(handle: AmpHandle, orig: Callable[..., Any]) -> Callable[..., Any]:
    """In-place FP32 functions of ``torch``: refuse fp16 arguments (always, as in Apex)."""

    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, torch.Tensor) and a.dtype == torch.float16
               for a in (*args, *kwargs.values())):
            raise NotImplementedError(
                f"Cannot call in-place function {orig.__name__} with fp16 arguments."
            )
        return orig(*args, **kwargs)

    return wrapper


def _err_if_arg0_half(handle: AmpHandle, orig: Callable[..., Any]) -> Callable[..., Any]:
    """In-place FP32 methods: refuse an fp16 ``self`` (always), else cast the others to fp32."""

    @functools.wraps(orig)
    def wrapper(arg0: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if arg0.dtype == torch.float16:
            raise NotImplementedError(
                f"Cannot call in-place method {orig.__name__} on fp16 Tensors."
            )
        new_args = [_cast(maybe_float, a) for a in args]
        return orig(arg0, *new_args, **{k: _cast(maybe_float, v) for k, v in kwargs.items()})

    return wrapper


def _plan() -> list[tuple[Any, str, Wrapper]]:
    """(namespace, name, wrapper factory) for every function O1 replaces, in Apex's order."""
    plan: list[tuple[Any, str, Wrapper]] = []
    for mod, fp16, fp32 in (
        (F, _FUNCTIONAL_FP16, _FUNCTIONAL_FP32),
        (torch, _TORCH_FP16, _TORCH_FP32),
        (torch.Tensor, _TENSOR_FP16, _TENSOR_FP32),
    ):
        plan += [(mod, n, _cast_args(maybe_half)) for n in fp16]
        plan += [(mod, n, _cast_args(maybe_float)) for n in fp32]
    plan += [(torch, f"{n}_", _err_if_any_half) for n in _TORCH_FP32]
    plan += [(torch.Tensor, f"{n}_", _err_if_arg0_half) for n in _TENSOR_FP32]
    plan += [(torch.Tensor, f"{n}_", _promote_match_arg0) for n in _TENSOR_FP16 + _TENSOR_CASTS]
    return [(mod, name, make) for mod, name, make in plan if hasattr(mod, name)]


PATCHED_TARGETS: list[tuple[Any, str]] = [(mod, name) for mod, name, _ in _plan()]
"""Every (namespace, name) that ``init`` replaces, for callers that must restore them."""


def init() -> AmpHandle:
    """Install the O1 wrappers and publish the handle as ``_amp_state.handle``."""
    handle = AmpHandle()
    for mod, name, make in _plan():
        orig = getattr(mod, name)
        handle._save_func(mod, name, orig)
        setattr(mod, name, make(handle, orig))
    _amp_state.handle = handle
    return handle
