"""Sampled targets for the true Fisher: losses at targets drawn from the model's own predictions.

Owns: the supported likelihoods and the loss whose output-gradients give G's statistics when
``KFAC(curvature=CurvatureConfig(fisher="sampled"))``, padded positions left out of it.
Must not know: hooks, blocks, the step (the caller hands the real positions in).

The true Fisher (Martens & Grosse 2015, §5) takes the expectation over targets ``y`` drawn from
the model's predictive distribution; one draw per sample gives an unbiased estimate. For outputs
``f`` of N samples, the per-sample loss ``ℓ`` and its output-gradient ``ĝ = ∂ℓ/∂f``:

- ``"cross_entropy"``: logits ``(N, C)``, ``y ~ Categorical(softmax(f))``, ``ℓ = -log softmax(f)_y``,
  ``E[ĝ ĝᵀ] = diag(p) - p pᵀ``; sequences: logits ``(N, T, C)`` (or ``(N, d1, ..., C)``, classes
  last), one draw per position and the sample's loss the **mean over its positions**, so
  ``ĝ_t = δ_t / T`` with ``E[δ_t δ_tᵀ] = diag(p_t) - p_t p_tᵀ``;
- ``"mse"``: predictions ``(N, ...)`` of D elements per sample, ``y = f + sqrt(D/2)·ε``,
  ``ε ~ N(0, I)``, ``ℓ = (1/D) Σ (f - y)²`` (``F.mse_loss`` per sample), ``E[ĝ ĝᵀ] = (2/D)·I``.

So the statistics are in the units of a mean-reduced ``F.cross_entropy`` / ``F.mse_loss`` training
loss, as the empirical ones are (docs/numerics.md, "The Fisher"; for sequences
``G = (1/T)·E_token[δδᵀ]`` on both paths, see "What N is"). The loss returned is the **sum** of the
per-sample losses: its output-gradients are the ``ĝ`` themselves, of order one, representable in
float16 without a loss scale.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from kfac_optim.layers.positions import RealPositions

logger = logging.getLogger(__name__)

Likelihood = Literal["cross_entropy", "mse"]
LIKELIHOODS: tuple[Likelihood, ...] = ("cross_entropy", "mse")


def check_likelihood(likelihood: str) -> Likelihood:
    """``likelihood`` if supported, else a ValueError naming the argument."""
    if likelihood not in LIKELIHOODS:
        raise ValueError(f"likelihood must be one of {LIKELIHOODS}, got {likelihood!r}")
    return likelihood


def _at_least_float32(tensor: Tensor) -> Tensor:
    """``tensor`` in float32, or as it is when already float32 or float64 (fp16/bf16 outputs are upcast)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


@torch.no_grad()
def sample_targets(outputs: Tensor, likelihood: Likelihood, generator: torch.Generator | None = None) -> Tensor:
    """Targets drawn from the predictive distribution that ``outputs`` parameterize (no grad).

    ``"cross_entropy"``: class indices ``(N, ...)`` (int64) for logits ``(N, ..., C)`` (one per
    position, drawn in row-major order); ``"mse"``: a tensor shaped like ``outputs``, in float32 or wider.
    """
    if check_likelihood(likelihood) == "cross_entropy":
        if outputs.dim() < 2 or outputs.shape[0] == 0 or outputs.shape[-1] < 2:
            raise ValueError(
                "likelihood 'cross_entropy' takes logits of shape (N, C) or (N, T, C) / (N, ..., C), classes last, "
                f"with C >= 2 classes, got outputs of shape {tuple(outputs.shape)}"
            )
        classes = outputs.shape[-1]
        probabilities = torch.softmax(_at_least_float32(outputs).reshape(-1, classes), dim=1)
        return torch.multinomial(probabilities, 1, generator=generator).reshape(outputs.shape[:-1])
    if outputs.dim() < 1 or outputs.shape[0] == 0:
        raise ValueError(f"likelihood 'mse' takes outputs of shape (N, ...), got {tuple(outputs.shape)}")
    mean = _at_least_float32(outputs)
    per_sample = mean[0].numel()
    noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
    return mean + noise * (per_sample / 2) ** 0.5


def sampled_loss(outputs: Tensor, likelihood: Likelihood, generator: torch.Generator | None = None,
                 real: RealPositions | None = None) -> Tensor:
    """The sum over samples of the per-sample loss at sampled targets (module docstring), in float32 or wider.

    ``"cross_entropy"`` on ``(N, ..., C)``: the sum over the N samples of each one's mean over its
    ``T = outputs[0].numel() / C`` positions. With the ``real`` positions of padded sequences (a
    mask shaped as the logits' leading dims; ``KFAC.mask`` or the model's ``attention_mask``):
    targets are drawn at the real positions only, in row-major order (so the draws do not depend
    on the padding), and ``T`` is the mean real length ``R/N``: the units of a loss that averages
    over the R real tokens, as Hugging Face's do."""
    outputs = _at_least_float32(outputs)
    if likelihood == "cross_entropy" and real is not None and tuple(real.mask.shape) == tuple(outputs.shape[:-1]):
        classes = outputs.shape[-1]
        where = torch.nonzero_static(real.mask.reshape(-1), size=real.count).squeeze(1)  # no host sync
        logits = outputs.reshape(-1, classes).index_select(0, where)
        targets = sample_targets(logits, likelihood, generator)
        return F.cross_entropy(logits, targets, reduction="sum") * outputs.shape[0] / max(real.count, 1)
    targets = sample_targets(outputs, likelihood, generator)
    if likelihood == "cross_entropy":
        classes = outputs.shape[-1]
        positions = outputs[0].numel() // classes
        return F.cross_entropy(outputs.reshape(-1, classes), targets.reshape(-1), reduction="sum") / positions
    return F.mse_loss(outputs, targets, reduction="sum") / outputs[0].numel()
