"""K-FAC under DDP and FSDP2 over NCCL (``pytest -m cuda``; skipped without CUDA).

One GPU allows one NCCL rank (NCCL refuses two ranks on one device), so DDP runs at world size 1:
NCCL's all-reduce of one rank is exact, and DDP's division by the world size is by 1, so the run
must equal one process without DDP bit for bit; a rank-0 checkpoint (``torch.save`` of
``optimizer.state_dict()``) taken mid-run must resume bit-identically. FSDP2 runs on two ranks,
skipped unless two GPUs exist, against one process on the concatenated batch. Ranks are spawned
by tests/distributed_helpers.py (file:// rendezvous, a deadline); each rank computes its own
control run on its device, so the test process never initializes CUDA.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kfac_optim import KFAC, RuntimeConfig
from tests.cuda_helpers import (
    cpu_copies,
    cuda_check_batch,
    cuda_check_net,
    cuda_test_device,
    cuda_test_marks,
    distributed_backend,
)
from tests.distributed_helpers import spawn

pytestmark = [*cuda_test_marks(), pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")]

NCCL_OPTIONS: dict[str, Any] = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.1, factor_update_steps=1,
                                    decomposition_update_steps=2)
NCCL_STEPS = 6
NCCL_SAVE_AT = 3  # after step 3, a factor step between the decomposition steps 2 and 4
NCCL_DEADLINE_S = 90.0


def rank_device(rank: int) -> torch.device:
    """This rank's device: CUDA device ``rank`` (NCCL), else the test device (gloo)."""
    device = cuda_test_device()
    return torch.device("cuda", rank) if device.type == "cuda" else device


def ddp_train_on_device(model: nn.Module, optimizer: KFAC, steps: range, device: torch.device) -> None:
    for step in steps:
        x, y = cuda_check_batch(step, device)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def ddp_wrapped(device: torch.device) -> DDP:
    model = cuda_check_net(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def nccl_ddp_scenario(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """Plain, DDP, and DDP resumed from a rank-0 checkpoint; every run's parameters on the CPU."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    device = rank_device(rank)
    results: dict[str, Any] = {"backend": dist.get_backend()}

    plain = cuda_check_net(device)
    ddp_train_on_device(plain, KFAC(plain, **NCCL_OPTIONS), range(NCCL_STEPS), device)
    results["plain"] = cpu_copies(dict(plain.named_parameters()))

    model = ddp_wrapped(device)
    optimizer = KFAC(model, **NCCL_OPTIONS)
    ddp_train_on_device(model, optimizer, range(NCCL_SAVE_AT + 1), device)
    checkpoint = directory / "nccl-rank0.pt"
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, checkpoint)
    dist.barrier()
    ddp_train_on_device(model, optimizer, range(NCCL_SAVE_AT + 1, NCCL_STEPS), device)
    results["ddp"] = cpu_copies(dict(model.module.named_parameters()))

    saved = torch.load(checkpoint, map_location=device, weights_only=True)
    resumed = ddp_wrapped(device)
    resumed.module.load_state_dict(saved["model"])
    resumed_optimizer = KFAC(resumed, **NCCL_OPTIONS)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    ddp_train_on_device(resumed, resumed_optimizer, range(NCCL_SAVE_AT + 1, NCCL_STEPS), device)
    results["resumed"] = cpu_copies(dict(resumed.module.named_parameters()))
    results["steps"] = (optimizer.steps, resumed_optimizer.steps)
    return results


@pytest.fixture(scope="module")
def nccl_ddp_rank(module_tmp_path: Path) -> dict[str, Any]:
    device = cuda_test_device()
    return spawn(nccl_ddp_scenario, 1, module_tmp_path, deadline_s=NCCL_DEADLINE_S,
                 backend=distributed_backend(device))[0]


def test_ddp_over_nccl_with_one_rank_equals_one_process_bit_for_bit(nccl_ddp_rank: dict[str, Any]) -> None:
    assert nccl_ddp_rank["backend"] == distributed_backend(cuda_test_device())
    torch.testing.assert_close(nccl_ddp_rank["ddp"], nccl_ddp_rank["plain"], rtol=0, atol=0)


def test_a_rank_zero_checkpoint_under_nccl_resumes_bit_identically(nccl_ddp_rank: dict[str, Any]) -> None:
    assert nccl_ddp_rank["steps"] == (NCCL_STEPS, NCCL_STEPS)
    torch.testing.assert_close(nccl_ddp_rank["resumed"], nccl_ddp_rank["ddp"], rtol=0, atol=0)


# -- FSDP2 on two ranks ---------------------------------------------------------------------------

FSDP_WORLD = 2
FSDP_BATCH = 16


def fsdp_mlp(device: torch.device) -> nn.Sequential:
    """Linear 8 → 16 → 12 → 3 (tanh): output sizes that two shards cut unevenly (12: 6 and 6; 3: 2 and 1)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3)).to(device)


def fsdp_global_batch(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(700 + step)
    return torch.randn(FSDP_BATCH, 8, generator=generator), torch.randint(0, 3, (FSDP_BATCH,), generator=generator)


def fsdp_train_on_device(model: nn.Module, optimizer: KFAC, device: torch.device, rank: int, world: int) -> None:
    """``NCCL_STEPS`` steps on rank ``rank``'s share of each global batch (all of it for ``world=1``)."""
    size = FSDP_BATCH // world
    for step in range(NCCL_STEPS):
        x, y = fsdp_global_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x[rank * size:(rank + 1) * size].to(device)),
                        y[rank * size:(rank + 1) * size].to(device)).backward()
        optimizer.step()


def nccl_fsdp_scenario(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """FSDP2 (every Linear and the root sharded) at ``grad_worker_fraction`` 1 and 0.5."""
    from torch.distributed.fsdp import fully_shard

    device = rank_device(rank)
    results: dict[str, Any] = {}
    for fraction in (1.0, 0.5):
        model = fsdp_mlp(device)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction=fraction), **NCCL_OPTIONS)
        fsdp_train_on_device(model, optimizer, device, rank, world)
        results[f"fsdp {fraction}"] = {name: p.full_tensor().detach().cpu() for name, p in model.named_parameters()}
    return results


@pytest.fixture(scope="module")
def nccl_fsdp_ranks(module_tmp_path: Path) -> list[dict[str, Any]]:
    return spawn(nccl_fsdp_scenario, FSDP_WORLD, module_tmp_path, deadline_s=NCCL_DEADLINE_S,
                 backend=distributed_backend(cuda_test_device()))


def fsdp_control() -> dict[str, Tensor]:
    """One process (this one), the unsharded model, the concatenated batch; on the CPU."""
    device = cuda_test_device()
    control = fsdp_mlp(device)
    fsdp_train_on_device(control, KFAC(control, **NCCL_OPTIONS), device, 0, 1)
    return cpu_copies(dict(control.named_parameters()))


def fsdp_ranks_available() -> bool:
    return cuda_test_device().type != "cuda" or torch.cuda.device_count() >= FSDP_WORLD


@pytest.mark.skipif(not fsdp_ranks_available(), reason=f"FSDP2 over NCCL needs {FSDP_WORLD} GPUs (one rank each)")
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_fsdp2_over_nccl_on_two_ranks_equals_one_process_on_the_concatenated_batch(
    nccl_fsdp_ranks: list[dict[str, Any]], fraction: float
) -> None:
    """Tolerance ``rtol=atol=1e-5`` (tests/distributed/test_fsdp.py's): the reduce-scatter adds the
    ranks' halves in another order than one process's sum over the batch."""
    control = fsdp_control()
    for results in nccl_fsdp_ranks:
        torch.testing.assert_close(results[f"fsdp {fraction}"], control, rtol=1e-5, atol=1e-5)
