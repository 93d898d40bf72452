"""K-FAC's background workers on CUDA (``pytest -m cuda``; skipped without CUDA).

The statistics worker (``RuntimeConfig(async_statistics=True)``) runs its work on the stream that
was current where it was submitted: the run must be bit-identical to the in-line one. The
decomposition worker (``AsyncConfig``) runs a round on its own stream: it must start after the
snapshots are written on the training stream and be waited for before its results are used;
each direction is tested with the other stream held up by ``torch.cuda._sleep``, so a missing
wait would read memory not yet written. The CUDA counterparts of
tests/integration/test_async_statistics.py and tests/optim/test_decompositions.py's async tests.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_optim import KFAC, AsyncConfig, RuntimeConfig, linalg
from tests.cuda_helpers import (
    cuda_check_batch,
    cuda_check_net,
    cuda_test_device,
    cuda_test_marks,
    deterministic_kernels,
)

pytestmark = cuda_test_marks()

HOLD_UP_CYCLES = 200_000_000
"""GPU clock cycles (about 0.1 s) that ``torch.cuda._sleep`` holds one stream up."""


def hold_up_current_stream() -> None:
    """Keep the current CUDA stream busy for a while (nothing on the CPU)."""
    if torch.cuda.is_available() and cuda_test_device().type == "cuda":
        torch.cuda._sleep(HOLD_UP_CYCLES)


def train_with_workers(async_statistics: bool, scaled: bool, steps: int = 9) -> tuple[list[Tensor], dict[str, Any]]:
    """``steps`` steps of :class:`CudaCheckNet` (factor interval 2, decompositions every 4); with a
    ``GradScaler`` when ``scaled``. Parameters and running factors, on the CPU."""
    device = cuda_test_device()
    model = cuda_check_net(device)
    optimizer = KFAC(model, lr=0.1, momentum=0.9, factor_update_steps=2, decomposition_update_steps=4,
                     runtime=RuntimeConfig(async_statistics=async_statistics))
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10) if scaled else None
    for step in range(steps):
        x, y = cuda_check_batch(step, device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    factors = {f"{b.name}.{n}": f.running.cpu().clone() for b in optimizer.blocks for n, f in b.factors.items()}
    return [p.detach().cpu().clone() for p in model.parameters()], factors


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad scaler"])
def test_async_statistics_on_cuda_train_bit_identically_to_in_line(
    monkeypatch: pytest.MonkeyPatch, scaled: bool
) -> None:
    deterministic_kernels(monkeypatch)
    in_line_params, in_line_factors = train_with_workers(False, scaled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no dropped pair
        params, factors = train_with_workers(True, scaled)
    assert all(torch.equal(a, b) for a, b in zip(in_line_params, params, strict=True))
    assert factors.keys() == in_line_factors.keys()
    for key, factor in factors.items():
        assert torch.equal(factor, in_line_factors[key]), key
        assert factor.abs().sum() > 0, f"{key} never updated: the comparison proves nothing"


def eigen_matrix(eigen: linalg.Eigen) -> Tensor:
    """``Q diag(d) Qᵀ`` on the CPU: a decomposition's matrix, whatever the signs of its eigenvectors."""
    Q, d = eigen.Q.cpu().double(), eigen.d.cpu().double()
    return (Q * d) @ Q.T


def test_an_async_round_on_cuda_decomposes_the_snapshot_written_on_the_training_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``decomposition_update_steps=3``: step 3 snapshots the factors (its stream held up first, so the
    snapshot is written late) and hands them to the worker, which writes its results late too (its
    stream held up before it copies them out); step 6 adopts them. They must be the decompositions
    of step 3's factors, computed in line."""
    real_symmetric_eigen = linalg.symmetric_eigen

    def late_results(*args: Any, **kwargs: Any) -> linalg.Eigen | None:
        result = real_symmetric_eigen(*args, **kwargs)
        if result is None or not threading.current_thread().name.startswith("kfac-decompositions"):
            return result
        hold_up_current_stream()  # the worker's stream
        return dataclasses.replace(result, Q=result.Q.clone(), d=result.d.clone())  # written after the hold-up

    monkeypatch.setattr(linalg, "symmetric_eigen", late_results)
    device = cuda_test_device()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 3)).to(device)
    optimizer = KFAC(net, lr=0.1, decomposition_update_steps=3, asynchronous=AsyncConfig(), factor_update_steps=1)
    block = optimizer.blocks[0]
    generator = torch.Generator().manual_seed(3)
    snapshots: dict[str, tuple[Tensor, int]] = {}
    for step in range(7):
        x, y = torch.randn(16, 20, generator=generator), torch.randint(0, 3, (16,), generator=generator)
        F.cross_entropy(net(x.to(device)), y.to(device)).backward()
        if step == 3:
            hold_up_current_stream()  # the training stream: the fold and the snapshot come after it
        optimizer.step()
        optimizer.zero_grad()
        if step == 3:
            snapshots = {name: (f.running.clone(), f.version) for name, f in block.factors.items()}
            thresholds = block.rank_thresholds(optimizer.method, 0.1)
        if step in (3, 5):
            assert block.A.decomposed_key == (1, 0.0)  # still step 0's
    for name, factor in block.factors.items():
        running, version = snapshots[name]
        expected = real_symmetric_eigen(running, torch.float32, thresholds[name])
        assert factor.decomposed_key == (version, 0.0)
        assert factor.decomposition.Q.shape == expected.Q.shape
        torch.testing.assert_close(eigen_matrix(factor.decomposition), eigen_matrix(expected), rtol=1e-5,
                                   atol=1e-6 * float(expected.d.abs().max()))
