"""The distribution-strategy seam (docs/design.md §5, "One strategy, chosen once"): a strategy
defined here, registered with ``register_strategy``, is chosen at construction and trains as the
built-in one it should equal, on one process and on two real gloo ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kfac_optim import KFAC, RuntimeConfig
from kfac_optim.distributed import (
    DistributionStrategy,
    Precondition,
    StrategySetting,
    block_work_items,
    register_strategy,
    unregister_strategy,
    whole_gradient_directions,
)
from kfac_optim.distributed.comm import Communicator
from kfac_optim.distributed.plan import Plan, make_plan
from kfac_optim.distributed.single import SingleProcess
from kfac_optim.layers import KroneckerBlock
from kfac_optim.methods import Method
from tests.distributed_helpers import assert_same_tensors, spawn

SEAM_STEPS = 5
SEAM_OPTIONS: dict[str, Any] = dict(lr=0.1, momentum=0.9, factor_update_steps=1, decomposition_update_steps=2)


class SeamNet(nn.Module):
    """Conv → tanh → two Linear layers: three K-FAC blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(32, 6)
        self.head = nn.Linear(6, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc(torch.tanh(self.conv(x)).flatten(1))))


def strategy_seam_batch(step: int, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s part of the global batch (8 samples) of ``step``."""
    generator = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(8, 1, 4, 4, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    size = 8 // world
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def strategy_seam_train(model: nn.Module, optimizer: KFAC, rank: int = 0, world: int = 1) -> None:
    for step in range(SEAM_STEPS):
        x, y = strategy_seam_batch(step, rank, world)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def strategy_seam_parameters(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# -- one process: a strategy that logs what the package asks of it --------------------------------


class CallLogStrategy(SingleProcess):
    """The single-process strategy, logging the seam's calls of a step (``local`` aside)."""

    def __init__(self, setting: StrategySetting) -> None:
        super().__init__(setting.blocks, setting.grad_worker_fraction, setting.process_group,
                         setting.bucket_bytes, setting.method)
        self.calls: list[str] = []

    def factors_folded(self) -> None:
        self.calls.append("factors_folded")

    def synchronize_factors(self, caller: str = "KFAC.step()", confirm: bool = False) -> None:
        self.calls.append("synchronize_factors")

    def share_decompositions(self, method: Method, dtype: torch.dtype) -> None:
        self.calls.append("share_decompositions")
        super().share_decompositions(method, dtype)

    def directions(self, blocks: Sequence[KroneckerBlock], precondition: Precondition,
                   dtype: torch.dtype) -> dict[Tensor, Tensor]:
        self.calls.append("directions")
        return super().directions(blocks, precondition, dtype)

    def summed_over_shards(self, terms: Tensor, params: Sequence[Tensor]) -> Tensor:
        self.calls.append("summed_over_shards")
        return terms


@pytest.fixture
def call_log_registered() -> Any:
    register_strategy("call_log", lambda setting: setting.world_size == 1, CallLogStrategy)
    yield
    unregister_strategy("call_log")


def test_a_registered_strategy_is_chosen_once_and_asked_every_step(call_log_registered: None) -> None:
    torch.manual_seed(0)
    model = SeamNet()
    optimizer = KFAC(model, **SEAM_OPTIONS)
    strategy = optimizer.estimator.strategy
    assert isinstance(strategy, CallLogStrategy)
    strategy_seam_train(model, optimizer)
    assert optimizer.estimator.strategy is strategy
    expected = []
    for step in range(SEAM_STEPS):  # every step folds (factor_update_steps=1); every other one decomposes
        expected.append("factors_folded")
        if step % 2 == 0:
            expected += ["synchronize_factors", "share_decompositions"]
        expected += ["directions", "summed_over_shards"]
    assert strategy.calls == expected


def test_a_registered_strategy_trains_as_the_built_in_one_bit_for_bit(call_log_registered: None) -> None:
    torch.manual_seed(0)
    model = SeamNet()
    strategy_seam_train(model, KFAC(model, **SEAM_OPTIONS))
    unregister_strategy("call_log")
    try:
        torch.manual_seed(0)
        control = SeamNet()
        control_optimizer = KFAC(control, **SEAM_OPTIONS)
        assert type(control_optimizer.estimator.strategy) is SingleProcess
        strategy_seam_train(control, control_optimizer)
    finally:
        register_strategy("call_log", lambda setting: setting.world_size == 1, CallLogStrategy)
    assert_same_tensors(strategy_seam_parameters(model), strategy_seam_parameters(control), rtol=0, atol=0)


def test_a_strategy_name_is_registered_once(call_log_registered: None) -> None:
    with pytest.raises(ValueError, match="'call_log' is registered already"):
        register_strategy("call_log", lambda setting: True, CallLogStrategy)
    with pytest.raises(ValueError, match="no distribution strategy 'nowhere'"):
        unregister_strategy("nowhere")


# -- two gloo ranks: a data-parallel strategy written against the protocol alone ------------------


class EveryRankDecomposes:
    """Data parallelism without sharded decompositions: the ranks average their running factors
    before each decomposition step, then every rank decomposes every factor itself, so nothing
    but the factors travels. Each rank runs the plan of one rank."""

    def __init__(self, setting: StrategySetting) -> None:
        self.plan: Plan = make_plan(block_work_items(setting.blocks), 1, method=setting.method)
        self.comm = Communicator(setting.process_group)
        self.blocks = list(setting.blocks)
        self.decompositions_missing = False
        self._folded = False
        self._factor_bytes = 0

    active = True
    whole_tensors = True
    broadcasts_directions = False

    def decomposes(self, block: str, factor: str) -> bool:
        return True

    def owned_factors(self) -> tuple[str, ...]:
        return tuple(f"{item.block}.{item.factor}" for item in self.plan.items)

    def bytes_communicated(self) -> dict[str, int]:
        return {"factors": self._factor_bytes, "decompositions": 0, "directions": 0}

    def factors_folded(self) -> None:
        self._folded = True

    def synchronize_factors(self, caller: str = "KFAC.step()", confirm: bool = False) -> None:
        if not self._folded:
            return
        factors = [factor for block in self.blocks for factor in block.factors_to_reduce()]
        counts = torch.stack([torch.stack([f.initialized.to(f.running.dtype), torch.tensor(
            float(f.rows_since_sync), dtype=f.running.dtype)]) for f in factors])
        for factor in factors:
            dist.all_reduce(factor.running, group=self.comm.group)
            self._factor_bytes += factor.running.nbytes
        dist.all_reduce(counts, group=self.comm.group)
        for factor, (ranks, rows) in zip(factors, counts, strict=True):
            factor.set_global(factor.running, ranks, int(rows))
        for block in self.blocks:
            block.after_factor_reduction()
        self._folded = False

    def sum_over_ranks(self, values: list[float], what: str) -> list[float]:
        total = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(total, group=self.comm.group)
        return total.tolist()

    def share_decompositions(self, method: Method, dtype: torch.dtype) -> None:
        self.decompositions_missing = False

    def directions(self, blocks: Sequence[KroneckerBlock], precondition: Precondition,
                   dtype: torch.dtype) -> dict[Tensor, Tensor]:
        return whole_gradient_directions(blocks, precondition, dict)

    def local(self, tensor: Tensor) -> Tensor:
        return tensor

    def summed_over_shards(self, terms: Tensor, params: Sequence[Tensor]) -> Tensor:
        return terms

    def preconditioning_bytes(self, dtype: torch.dtype) -> int:
        return 0

    def resharded(self, param: Tensor) -> bool:
        return False

    def loaded(self) -> None:
        self._folded = False
        self.decompositions_missing = any(
            bool(f.initialized) and f.decomposition is None for b in self.blocks for f in b.factors.values()
        )


def every_rank_decomposes(setting: StrategySetting) -> DistributionStrategy:
    """The builder ``register_strategy`` takes: a class written against the protocol is one."""
    return EveryRankDecomposes(setting)


def seam_ddp_run(rank: int, world: int) -> tuple[dict[str, Tensor], KFAC]:
    torch.manual_seed(0)
    model = SeamNet()
    ddp = DDP(model)
    optimizer = KFAC(ddp, runtime=RuntimeConfig(grad_worker_fraction=1), **SEAM_OPTIONS)
    strategy_seam_train(ddp, optimizer, rank, world)
    return strategy_seam_parameters(model), optimizer


def seam_scenario_two_ranks(rank: int, world: int, directory: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    params, optimizer = seam_ddp_run(rank, world)
    results["built-in"] = (type(optimizer.estimator.strategy).__name__, params, optimizer.bytes_communicated())
    register_strategy("every_rank_decomposes", lambda setting: setting.world_size > 1, every_rank_decomposes)
    try:
        params, optimizer = seam_ddp_run(rank, world)
    finally:
        unregister_strategy("every_rank_decomposes")
    results["registered"] = (type(optimizer.estimator.strategy).__name__, params, optimizer.bytes_communicated(),
                             optimizer.owned_factors)
    return results


@pytest.fixture(scope="module")
def seam_two_ranks(module_tmp_path: Path) -> list[dict[str, Any]]:
    return spawn(seam_scenario_two_ranks, 2, module_tmp_path, deadline_s=90.0)


def test_the_built_in_choice_on_two_ddp_ranks_is_data_parallel(seam_two_ranks: list[dict[str, Any]]) -> None:
    assert [r["built-in"][0] for r in seam_two_ranks] == ["DataParallel", "DataParallel"]


def test_a_strategy_written_against_the_protocol_trains_as_data_parallel_bit_for_bit(
    seam_two_ranks: list[dict[str, Any]],
) -> None:
    for rank in seam_two_ranks:
        name, params, sent, owned = rank["registered"]
        assert name == "EveryRankDecomposes"
        assert owned == ("conv.A", "conv.G", "fc.A", "fc.G", "head.A", "head.G")
        assert sent["decompositions"] == 0 < sent["factors"]
        assert rank["built-in"][2]["decompositions"] > 0  # the built-in one shares them instead
        assert_same_tensors(params, rank["built-in"][1], rtol=0, atol=0)
