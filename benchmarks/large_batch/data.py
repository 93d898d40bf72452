"""MNIST-1D-style data, generated procedurally (no download): ten 1-D digit templates, each sample a
random placement, stretch, amplitude, shear and noise of one of them (after Greydanus 2020, "Scaling
down deep learning": MNIST-1D; our own generator and templates, not the ``mnist1d`` package's data).

Owns: the generator and the fixed train / validation / test split. Must not know: models, optimizers.

A sample, at ``LENGTH`` points ``t`` in [0, 1]: the template (12 values) linearly interpolated over a
window ``[offset, offset + width]`` (0 outside), times an amplitude, plus a shear ``slope·(t − ½)``,
noise correlated along ``t`` (white noise smoothed by a 5-point box) and white noise; every draw from
one ``torch.Generator`` seeded by the split, so the data are the same on every machine and run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

LENGTH = 40
TEMPLATES = torch.tensor([
    [5, 6, 6.5, 6.75, 7, 7, 7, 7, 6.75, 6.5, 6, 5],
    [5, 3, 3, 3.4, 3.8, 4.2, 4.6, 5, 5.4, 5.8, 5, 5],
    [5, 6, 6.5, 6.5, 6, 5.25, 4.75, 4, 3.5, 3.5, 4, 5],
    [5, 6, 6.5, 6.5, 6, 5, 5, 6, 6.5, 6.5, 6, 5],
    [5, 4.4, 3.8, 3.2, 2.6, 2.6, 5, 5, 5, 5, 5, 5],
    [5, 3, 3, 3, 3, 5, 6, 6.5, 6.5, 6, 4.5, 5],
    [5, 4, 3.5, 3.25, 3, 3, 3, 3, 3.25, 3.5, 4, 5],
    [5, 7, 7, 6.6, 6.2, 5.8, 5.4, 5, 4.6, 4.2, 5, 5],
    [5, 4, 3.5, 3.5, 4, 5, 5, 4, 3.5, 3.5, 4, 5],
    [5, 4, 3.5, 3.5, 4, 5, 5, 5, 5, 4.7, 4.3, 5],
]) - 5.0
"""Ten 1-D digit shapes (values around 0)."""
SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}


@dataclass(frozen=True)
class Noise:
    """How hard the data are: window width range, shear, correlated and white noise scales."""

    width: tuple[float, float] = (0.4, 0.75)
    amplitude: tuple[float, float] = (0.7, 1.3)
    slope: float = 0.8
    correlated: float = 0.25
    white: float = 0.2


def generate(count: int, seed: int, noise: Noise = Noise()) -> tuple[Tensor, Tensor]:
    """``count`` samples ``(count, 1, LENGTH)`` float32 and their labels ``(count,)`` int64."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (count,), generator=g)
    width = noise.width[0] + (noise.width[1] - noise.width[0]) * torch.rand(count, 1, generator=g)
    offset = (1 - width) * torch.rand(count, 1, generator=g)
    amplitude = noise.amplitude[0] + (noise.amplitude[1] - noise.amplitude[0]) * torch.rand(count, 1, generator=g)
    slope = noise.slope * (2 * torch.rand(count, 1, generator=g) - 1)
    t = torch.linspace(0, 1, LENGTH).expand(count, LENGTH)
    u = (t - offset) / width * (TEMPLATES.shape[1] - 1)           # template coordinate
    inside = (u >= 0) & (u <= TEMPLATES.shape[1] - 1)
    low = u.clamp(0, TEMPLATES.shape[1] - 2).floor().long()
    share = (u - low).clamp(0, 1)
    rows = TEMPLATES[labels]
    signal = rows.gather(1, low) * (1 - share) + rows.gather(1, low + 1) * share
    signal = torch.where(inside, signal, torch.zeros(()))
    smooth = F.avg_pool1d(torch.randn(count, 1, LENGTH + 4, generator=g), 5, stride=1).squeeze(1)
    x = amplitude * signal + slope * (t - 0.5) + noise.correlated * smooth * 5 ** 0.5 \
        + noise.white * torch.randn(count, LENGTH, generator=g)
    return x.unsqueeze(1).float(), labels


@dataclass(frozen=True)
class Splits:
    train: tuple[Tensor, Tensor]
    val: tuple[Tensor, Tensor]
    test: tuple[Tensor, Tensor]


@functools.cache
def splits(train: int = 32_000, val: int = 4_000, test: int = 4_000) -> Splits:
    """The fixed splits (40k samples by default), each from its own seed; cached per process."""
    return Splits(generate(train, SPLIT_SEEDS["train"]), generate(val, SPLIT_SEEDS["val"]),
                  generate(test, SPLIT_SEEDS["test"]))
