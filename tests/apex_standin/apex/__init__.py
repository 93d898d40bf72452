"""CPU stand-in for NVIDIA Apex's legacy ``apex.amp`` API, for tests only.

Real Apex needs CUDA; this package follows the published Apex sources (behaviour of the legacy
``amp`` code through Apex 25.05, where it is frozen and deprecated) closely enough that an
optimizer which trains under it trains under the real thing. Read in ``NVIDIA/apex``:
``apex/amp/{frontend,_initialize,_process_optimizer,handle,scaler,amp,wrap,utils,_amp_state}.py``,
``apex/amp/lists/*.py`` and ``apex/fp16_utils/fp16util.py``.

Modelled, each in the module named after the Apex file it follows:

- ``frontend.py``: ``amp.initialize`` with opt levels O0-O3, property overrides, ``enabled=False``,
  ``amp.state_dict()`` / ``amp.load_state_dict()`` (``loss_scaler%d`` -> loss_scale, unskipped).
- ``_initialize.py``: O2/O3 cast the model to fp16 (``convert_network`` keeps affine BatchNorm fp32;
  parameters keep their identity, only ``.data`` changes); ``model.forward`` is patched to cast
  floating inputs to fp16 and outputs to fp32; ``optimizer.load_state_dict(optimizer.state_dict())``
  after the cast; fp32 ``model.state_dict()`` hooks; O1 wraps ``optimizer.step`` in
  ``disable_casts``; one ``LossScaler`` per loss in ``_amp_state.loss_scalers``.
- ``_process_optimizer.py``: ``optimizer._amp_stash``; lazy init on the first ``scale_loss`` (or
  patched ``zero_grad``) that, for master weights, puts fresh fp32 clones into
  ``param_groups[i]["params"]`` in place of fp16 params, moves their ``optimizer.state`` entries and
  calls ``load_state_dict(state_dict())`` again; ``all_fp16_params`` / ``all_fp32_from_fp16_params``
  / ``all_fp32_from_fp32_params`` lists; the O2 ``step`` patch (no arguments; copies master ->
  model, sets master grads to None) and ``zero_grad`` patch; grad stashing for accumulation.
- ``handle.py``: ``scale_loss`` (yields ``loss.float() * scale``; on exit unscales into master grads
  or in place, updates the scale and, on overflow, replaces ``optimizer.step`` by a one-shot
  ``skip_step`` that clears master grads, sets ``most_recent_scale``/``scale_set_by_backward`` when
  the optimizer has them, and restores the previous ``step``); ``disable_casts``; ``AmpHandle``.
- ``scaler.py``: ``LossScaler`` with the fused-kernel semantics (every grad unscaled, one overflow
  flag read in ``update_scale``, checked only for dynamic scaling); halve on overflow (floored at
  ``min_loss_scale``), double after 2000 clean steps (capped at ``max_loss_scale``).
- ``amp.py``: O1's patching of ``torch``, ``torch.nn.functional`` and ``torch.Tensor`` functions
  from Apex's FP16/FP32 lists (cast wrappers, in-place type matching, in-place fp32 functions
  refusing fp16), active while ``_amp_state.handle.is_active()``.

Substitutions (CPU instead of CUDA): tensor types are tested by dtype, so CPU fp16/fp32 tensors
stand for ``torch.cuda.HalfTensor``/``FloatTensor``; O1 casts CPU tensors (Apex casts only CUDA
ones); overflow is found with ``torch.isfinite`` instead of ``amp_C`` kernels.

Left out: fused optimizers (FusedAdam/FusedSGD/LARC) and their stash paths, the O1 cast cache
(casts are redone each call; same values), non-in-place type promotion (``add``, ``cat``, ...,
which torch's own type promotion already resolves to fp32), RNN casts, banned-function errors,
user function registries, ``delay_overflow_check``, property consistency warnings, the
"not CUDA" warnings and rank-0-only printing.
"""

from . import amp

__all__ = ["amp"]
