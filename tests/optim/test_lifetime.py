"""``KFAC``'s lifetime: freed by reference counting, as ``torch.optim.SGD`` is.

Nothing the optimizer builds (its estimator, hooks, checkpoint and Join support, workers) may refer
back to it strongly: a reference cycle keeps the optimizer, the model and whatever the model holds
(a DDP wrapper's reducer and process group, with gloo's native threads) alive after the user's
last reference goes, until a garbage collection runs, or in a spawned rank until interpreter exit.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, AsyncConfig, CurvatureConfig, RuntimeConfig
from tests.helpers import seeded_batch


@pytest.fixture
def garbage_collector_off() -> Iterator[None]:
    """No garbage collection while the test runs (only reference counting frees objects)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def lifetime_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(32, 3))


@pytest.mark.parametrize("options", [
    {},
    {"method": "inverse"},
    {"method": "eigen_adam", "momentum": 0.0},
    {"asynchronous": AsyncConfig()},
    {"runtime": RuntimeConfig(async_statistics=True)},
    {"curvature": CurvatureConfig(fisher="sampled")},
    {"runtime": RuntimeConfig(grad_scaler=torch.amp.GradScaler("cpu", enabled=False))},
], ids=["eigen", "inverse", "eigen_adam", "async decompositions", "async statistics", "sampled fisher", "grad_scaler"])
def test_kfac_and_its_model_are_freed_when_the_last_reference_goes(
    options: dict[str, Any], garbage_collector_off: None
) -> None:
    model = lifetime_net()
    optimizer = KFAC(model, **{"lr": 0.1, "momentum": 0.9, "factor_update_steps": 1, "decomposition_update_steps": 2,
                               **options})
    sampled = optimizer.options.curvature.fisher == "sampled"
    for step in range(3):  # decompositions at steps 0 and 2: every lazily built part exists
        x, y = seeded_batch((8, 1, 4, 4), 3, seed=step)
        optimizer.zero_grad()
        out = model(x)
        if sampled:
            optimizer.sample_fisher(out, "cross_entropy", generator=torch.Generator().manual_seed(step))
        F.cross_entropy(out, y).backward()
        optimizer.step()
    refs = {"KFAC": weakref.ref(optimizer), "model": weakref.ref(model)}
    del model, optimizer, out
    assert {name: ref() is None for name, ref in refs.items()} == {"KFAC": True, "model": True}
