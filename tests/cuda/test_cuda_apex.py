"""K-FAC under the real NVIDIA Apex amp (O1, O2) on CUDA (``pytest -m cuda``): skipped unless Apex
is importable (it is not a dependency: the CPU suite tests against the stand-in in
tests/apex_standin, tests/integration/test_apex.py) and CUDA is there. Each opt level trains the
stand-in suite's MLP and is compared with plain fp32 K-FAC, with that suite's tolerances."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import running_factors
from torch import Tensor, nn

from kfac_optim import KFAC
from tests.cuda_helpers import cuda_test_device, cuda_test_marks

pytestmark = cuda_test_marks()

APEX_OPTIONS: dict[str, Any] = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.1, factor_update_steps=1,
                                    decomposition_update_steps=2)
STANDIN = Path(__file__).resolve().parents[1] / "apex_standin"


def real_apex_amp() -> ModuleType:
    """The real ``apex.amp`` (never the stand-in), or skip."""
    if cuda_test_device().type != "cuda":
        pytest.skip("Apex amp needs CUDA")
    if importlib.util.find_spec("apex") is None:
        pytest.skip("NVIDIA Apex is not installed (the stand-in suite, tests/integration/test_apex.py, runs instead)")
    apex = importlib.import_module("apex")
    if STANDIN in Path(apex.__file__).resolve().parents:
        pytest.skip("`apex` is the CPU stand-in here, not NVIDIA Apex")
    return importlib.import_module("apex.amp")


def apex_check_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(),
                         nn.Linear(12, 3)).to(cuda_test_device())


def apex_check_batch(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(10 + step)
    x = torch.randn(32, 8, generator=generator)
    y = (x @ torch.randn(8, 3, generator=generator)).argmax(dim=1)
    return x.to(cuda_test_device()), y.to(cuda_test_device())


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_training_under_real_apex_follows_fp32_kfac(opt_level: str) -> None:
    amp = real_apex_amp()
    model = apex_check_mlp()
    model, optimizer = amp.initialize(model, KFAC(model, **APEX_OPTIONS), opt_level=opt_level, verbosity=0)
    try:
        for step in range(6):
            x, y = apex_check_batch(step)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
    finally:
        handle = getattr(amp._amp_state, "handle", None)  # undo O1's patching of torch functions
        if handle is not None:
            handle._deactivate()
    control_model = apex_check_mlp()
    control = KFAC(control_model, **APEX_OPTIONS)
    for step in range(6):
        x, y = apex_check_batch(step)
        control.zero_grad()
        F.cross_entropy(control_model(x), y).backward()
        control.step()
    assert optimizer.steps == control.steps == 6
    factors, expected = running_factors(optimizer), running_factors(control)
    assert all(f.dtype is torch.float32 for f in factors.values())
    torch.testing.assert_close({k: v.cpu() for k, v in factors.items()}, {k: v.cpu() for k, v in expected.items()},
                               rtol=3e-2, atol=1e-3)
    owned, expected_owned = ([p.detach().float().cpu() for group in opt.param_groups for p in group["params"]]
                             for opt in (optimizer, control))  # O2: the fp32 masters
    torch.testing.assert_close(owned, expected_owned, rtol=2e-2, atol=2e-3)
