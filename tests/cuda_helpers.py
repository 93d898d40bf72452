"""What the CUDA tests (tests/cuda, ``pytest -m cuda``) share: the device they run on, their marks,
a small model and its batches.

Without CUDA every test there skips with the reason. ``KFAC_TEST_DEVICE`` (default ``cuda``) points
them at another device: ``KFAC_TEST_DEVICE=cpu pytest -m cuda tests/cuda`` runs their bodies on
the CPU (gloo for NCCL, ``GradScaler("cpu")``, no streams), to check the tests themselves on a
machine without a GPU; what they prove about CUDA needs a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded_batch
from torch import Tensor, nn

DEVICE_VARIABLE = "KFAC_TEST_DEVICE"


def cuda_test_device() -> torch.device:
    """The device the CUDA tests run on: ``$KFAC_TEST_DEVICE``, default ``cuda`` (the current CUDA device)."""
    return torch.device(os.environ.get(DEVICE_VARIABLE, "cuda"))


def cuda_test_marks() -> list[pytest.MarkDecorator]:
    """A CUDA test module's ``pytestmark``: the ``cuda`` marker, and a skip when its device is CUDA
    and there is none."""
    missing = cuda_test_device().type == "cuda" and not torch.cuda.is_available()
    reason = (f"needs a CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}); "
              f"{DEVICE_VARIABLE}=cpu runs these tests' bodies on the CPU")
    return [pytest.mark.cuda, pytest.mark.skipif(missing, reason=reason)]


def distributed_backend(device: torch.device) -> str:
    """NCCL on CUDA, gloo elsewhere."""
    return "nccl" if device.type == "cuda" else "gloo"


def deterministic_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuDNN's deterministic convolutions (a bit-for-bit comparison of two runs needs them: the
    default may pick kernels that add in a different order from run to run) and no TF32, for this test."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


class CudaCheckNet(nn.Module):
    """Conv (3 → 4, stride 2) → ReLU → Linear → tanh → Linear on ``(N, 3, 6, 6)`` images, 10 classes.

    Three K-FAC blocks, every factor at most 37 wide: below the default eigenbasis cap (128), whose
    randomized solver draws from the device's generator (another stream of numbers on CUDA than on
    the CPU), so the CPU and CUDA steps compute the same thing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.fc1 = nn.Linear(4 * 3 * 3, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(F.relu(self.conv(x)).flatten(1))))


def cuda_check_net(device: torch.device, dtype: torch.dtype = torch.float32) -> CudaCheckNet:
    """A :class:`CudaCheckNet` with seed-0 weights (the same on every device), on ``device`` in ``dtype``."""
    torch.manual_seed(0)
    return CudaCheckNet().to(device=device, dtype=dtype)


def cuda_check_batch(step: int, device: torch.device, dtype: torch.dtype = torch.float32,
                     size: int = 16) -> tuple[Tensor, Tensor]:
    """Batch ``step`` for :class:`CudaCheckNet`: drawn on the CPU in float32 (the same numbers on every
    device and in every dtype), then moved and cast."""
    x, y = seeded_batch((size, 3, 6, 6), 10, seed=500 + step)
    return x.to(device, dtype), y.to(device)


def cpu_copies(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Detached CPU copies of ``tensors`` (to compare runs on different devices)."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in tensors.items()}
