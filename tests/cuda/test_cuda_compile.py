"""``torch.compile`` on CUDA with K-FAC's compiled capture path (``pytest -m cuda``; skipped
without CUDA): the model compiled whole (``fullgraph=True``) by inductor, its Triton kernels feeding
the factors (docs/design.md §4, "Compiled models"). The CUDA counterpart of
tests/integration/test_feeding.py's compiled tests, against the same loop run eagerly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import running_factors

from kfac_optim import KFAC
from tests.cuda_helpers import (
    cpu_copies,
    cuda_check_batch,
    cuda_check_net,
    cuda_test_device,
    cuda_test_marks,
    deterministic_kernels,
)

pytestmark = cuda_test_marks()


def test_an_inductor_compiled_model_on_cuda_feeds_the_factors_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three steps (a factor step each, decompositions at 0 and 2) of the compiled model and of the
    eager one, TF32 off. Tolerance ``rtol=1e-4, atol=1e-6``: inductor's fused kernels add in another
    order than eager's (float32 eps 1.2e-7 over sums of up to 256 terms), nothing more."""
    deterministic_kernels(monkeypatch)
    device = cuda_test_device()
    torch._dynamo.reset()
    model, eager = cuda_check_net(device), cuda_check_net(device)
    options = dict(lr=0.05, momentum=0.9, damping=0.1, factor_update_steps=1, decomposition_update_steps=2)
    optimizer, eager_optimizer = KFAC(model, **options), KFAC(eager, **options)
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    for step in range(3):
        x, y = cuda_check_batch(step, device)
        for net, opt in ((compiled, optimizer), (eager, eager_optimizer)):
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    assert optimizer.steps == eager_optimizer.steps == 3
    expected = cpu_copies(running_factors(eager_optimizer))
    assert all(factor.abs().sum() > 0 for factor in expected.values())
    torch.testing.assert_close(cpu_copies(running_factors(optimizer)), expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(cpu_copies(dict(model.named_parameters())), cpu_copies(dict(eager.named_parameters())),
                               rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()
