"""Distributed K-FAC on real gloo ranks against one process on the concatenated batch (docs/design.md §5, §8).

Each scenario group is one spawn of 2, 3 or 4 CPU ranks (tests/distributed_helpers.py: file://
rendezvous in a tmp dir, one thread each, a deadline that fails the test instead of hanging).
The ranks run DDP on their shard of every global batch and save what they ended with; the tests
compare it, in this process, with a control run of one process on the whole batch.
"""

from __future__ import annotations

import gc
import io
import weakref
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kfac_optim import KFAC, AsyncConfig, CurvatureConfig, RuntimeConfig
from kfac_optim.distributed.comm import Communicator
from kfac_optim.methods import Eigen
from tests.distributed_helpers import assert_same_tensors, spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

GLOBAL_BATCH = 12  # divisible by 2, 3 and 4 ranks
STEPS = 6
SAVE_AT = 3  # right after a decomposition step (decomposition_update_steps=2: steps 0, 2, 4)
DEADLINE_S = 90.0
OPTIONS: dict[str, Any] = dict(
    lr=0.1, momentum=0.9, weight_decay=1e-3, damping=0.1, kl_clip=1e-2,
    curvature=CurvatureConfig(factor_decay=0.9), decomposition_update_steps=2
)
TOLERANCE = dict(rtol=1e-4, atol=1e-6)
assert_same = partial(assert_same_tensors, **TOLERANCE)  # rtol=0, atol=0 for bit-identity
# phases 0-2 over 4 blocks
STAGGER: dict[str, Any] = dict(curvature=CurvatureConfig(factor_decay=0.9, stagger=True), factor_update_steps=3)
DEFAULT_INTERVALS: dict[str, Any] = dict(factor_update_steps="auto", decomposition_update_steps="auto")
DEFAULT_STEPS = 12  # past the first automatic decomposition interval (at least 10)


class DdpNet(nn.Module):
    """Conv → tanh → three Linear layers: four K-FAC blocks of different sizes.

    ``unused`` is never called; ``branch`` is called only when ``use_branch`` (set per rank).
    """

    def __init__(self, extra_layers: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc1 = nn.Linear(32, 8)
        self.fc2 = nn.Linear(8, 6, bias=False)
        self.head = nn.Linear(6, 3)
        self.use_branch = False
        if extra_layers:
            self.unused = nn.Linear(6, 6)
            self.branch = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(torch.tanh(self.conv(x)).flatten(1)))))
        if self.use_branch:
            h = h + self.branch(h)
        return self.head(h)


class ModernNet(nn.Module):
    """Every block kind beyond Linear/Conv2d: an embedding (diagonal A), self-attention (packed
    in_proj, out_proj), a depthwise Conv1d and a grouped Conv1d (batched per-group factors), a
    Conv3d, then a Linear head. Input: tokens (N, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 6, padding_idx=0)
        self.attention = nn.MultiheadAttention(6, 2, batch_first=True)
        self.depthwise = nn.Conv1d(6, 6, 3, padding=1, groups=6)
        self.grouped = nn.Conv1d(6, 4, 1, groups=2, bias=False)
        self.volume = nn.Conv3d(1, 2, (2, 2, 1))
        self.head = nn.Linear(2 * 3 * 4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embedding(tokens)
        h = h + self.attention(h, h, h, need_weights=False)[0]
        h = torch.tanh(self.depthwise(h.transpose(1, 2)))
        h = torch.tanh(self.grouped(h))  # (N, 4, 5)
        h = torch.tanh(self.volume(h.unsqueeze(1).unsqueeze(-1)))  # (N, 2, 3, 4, 1)
        return self.head(h.flatten(1))


def make_ddp_net(extra_layers: bool = False, modern: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return ModernNet() if modern else DdpNet(extra_layers)


def global_batch(step: int, modern: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    if modern:
        x = torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=generator)
    else:
        x = torch.randn(GLOBAL_BATCH, 1, 4, 4, generator=generator)
    return x, torch.randint(0, 3, (GLOBAL_BATCH,), generator=generator)


def ddp_shard(step: int, rank: int, world: int, modern: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, modern)
    size = GLOBAL_BATCH // world
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def ddp_train(
    model: nn.Module,
    optimizer: KFAC,
    steps: range,
    rank: int = 0,
    world: int = 1,
    micro_batches: int = 1,
    after_step: Callable[[], None] = lambda: None,
) -> None:
    """Steps on this rank's shard; ``micro_batches`` > 1 accumulates under DDP ``no_sync``."""
    modern = isinstance(model.module if isinstance(model, DDP) else model, ModernNet)
    for step in steps:
        x, y = ddp_shard(step, rank, world, modern)
        optimizer.zero_grad()
        for index, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True)):
            last = index == micro_batches - 1
            context = model.no_sync() if isinstance(model, DDP) and not last else nullcontext()
            with context:
                out = model(xs)
                if optimizer.options.curvature.fisher == "sampled":  # shard k of the global batch: its own draws
                    draws = torch.Generator().manual_seed(10_000 + 100 * step + rank * micro_batches + index)
                    optimizer.sample_fisher(out, "cross_entropy", generator=draws)
                (F.cross_entropy(out, ys) / micro_batches).backward()
        optimizer.step()
        after_step()


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, DDP) else model
    return {name: p.detach().clone() for name, p in inner.named_parameters()}


def saved_factors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {
        f"{block}.{name}": factor["running"]
        for block, block_state in state["kfac"]["blocks"].items()
        for name, factor in block_state["factors"].items()
    }


def global_factors(optimizer: KFAC) -> dict[str, torch.Tensor]:
    """The global running factors as ``state_dict()`` saves them (packed), by ``"<block>.<A|G>"``:
    ``state_dict()`` holds this rank's, so ``synchronize_factors()`` (a collective) first."""
    optimizer.synchronize_factors()
    return saved_factors(optimizer.state_dict())


def symmetric_matrices(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    matrices = [torch.randn(n, n, generator=generator) for n in (5, 1, 9)]
    matrices.append(torch.randn(4, 4, generator=generator, dtype=torch.float64))
    return [m + m.T for m in matrices]


MODERN_RUNS = [(1.0, "eigen"), ("mem-opt", "inverse"), ("mem-opt", "root")]  # root: its Eigen bases travel
# fc1's A (33), conv's A (10), fc2's A and G (8 each), head's A (7): truncated at step 0 (12 rows)
CAPPED = Eigen(max_rank=4)


def ddp_run(
    rank: int, world: int, fraction: float | str, steps: range = range(STEPS), **kwargs: Any
) -> tuple[DDP, KFAC]:
    model = DDP(make_ddp_net())
    optimizer = KFAC(model, **{"runtime": RuntimeConfig(grad_worker_fraction=fraction), "factor_update_steps": 1,
                               "decomposition_update_steps": 10, **{**OPTIONS, **kwargs}})
    ddp_train(model, optimizer, steps, rank, world)
    return model, optimizer


# -- what the ranks do --------------------------------------------------------------------------


def ddp_scenario_two_ranks(rank: int, world: int, directory: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for fraction in (1.0, "mem-opt"):
        model, optimizer = ddp_run(rank, world, fraction)
        results[f"params {fraction}"] = parameters(model)
        results[f"factors {fraction}"] = global_factors(optimizer)
        results[f"memory {fraction}"] = optimizer.memory_usage()

    model = DDP(make_ddp_net())
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    ddp_train(model, optimizer, range(STEPS), rank, world, after_step=optimizer.synchronize_factors)
    results["factors eager"] = global_factors(optimizer)

    model = DDP(make_ddp_net())
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    ddp_train(model, optimizer, range(STEPS), rank, world, micro_batches=2)
    results["params no_sync"] = parameters(model)

    model = DDP(make_ddp_net())
    # comm-opt: every rank receives the decompositions it does not own
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    storage: list[dict[str, int]] = []

    def record_received_storage() -> None:
        storage.append({
            f"{block.name}.{name}": (factor.decomposition.Q.data_ptr(), tuple(factor.decomposition.Q.shape))
            for block in optimizer.blocks for name, factor in block.factors.items()  # noqa: F821 (bound above: the `del` at the function's end comes after its last call)
            if factor.decomposition is not None and not optimizer.estimator.strategy.decomposes(block.name, name)  # noqa: F821 (as above)
        })

    ddp_train(model, optimizer, range(STEPS), rank, world, after_step=record_received_storage)
    results["received decomposition storage"] = storage

    model, optimizer = ddp_run(rank, world, 1.0, curvature=CurvatureConfig(factor_decay=0.9, fisher="sampled"))
    results["params sampled"] = parameters(model)
    results["factors sampled"] = global_factors(optimizer)

    model, optimizer = ddp_run(rank, world, 1.0, asynchronous=AsyncConfig())
    results["params async"] = parameters(model)
    results["factors async"] = global_factors(optimizer)
    model, optimizer = ddp_run(rank, world, 1.0, asynchronous=AsyncConfig(),
                               runtime=RuntimeConfig(grad_worker_fraction=1.0, async_statistics=True))
    results["params async statistics"] = parameters(model)
    results["factors async statistics"] = global_factors(optimizer)
    results.update(async_resumed(rank, world))
    results.update(async_delay_with_a_rank_that_decomposes_nothing(rank, world))

    for fraction in (1.0, "mem-opt"):  # truncated decompositions (and their σ) travel to the other rank
        model, optimizer = ddp_run(rank, world, fraction, method=CAPPED)
        results[f"params capped {fraction}"] = parameters(model)

    model, optimizer = ddp_run(rank, world, 1.0, steps=range(DEFAULT_STEPS), **DEFAULT_INTERVALS)
    results["params default intervals"] = parameters(model)
    results["chosen default intervals"] = optimizer.estimator.intervals.chosen

    model, optimizer = ddp_run(rank, world, "mem-opt", **STAGGER)
    results["params stagger"] = parameters(model)
    results["factors stagger"] = global_factors(optimizer)

    model = DDP(make_ddp_net(extra_layers=True), find_unused_parameters=True)
    model.module.use_branch = rank == 0
    optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction="mem-opt"),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    ddp_train(model, optimizer, range(STEPS), rank, world)
    results["params unused"] = parameters(model)
    results["factors unused"] = global_factors(optimizer)

    communicator = Communicator(bucket_bytes=64)  # a few entries per bucket: many buckets
    results["comm sums"] = communicator.all_reduce_sum(symmetric_matrices(rank), symmetric=True).wait()
    inputs = symmetric_matrices(rank)
    sums = communicator.all_reduce_sum(inputs, symmetric=True, in_place=True).wait()
    results["comm sums in place"] = sums
    results["comm sums are the inputs"] = all(a is b for a, b in zip(sums, inputs, strict=True))
    sent = [torch.full((2, 3), float(rank)), torch.full((5,), float(rank), dtype=torch.float64)]
    results["comm broadcast"] = communicator.broadcast(sent, src=1, ranks=(0, 1)).wait()

    for fraction, method in MODERN_RUNS:
        model = DDP(make_ddp_net(modern=True))
        optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction=fraction), method=method,
                         **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
        ddp_train(model, optimizer, range(STEPS), rank, world)
        results[f"modern params {fraction} {method}"] = parameters(model)
        results[f"modern factors {fraction} {method}"] = global_factors(optimizer)

    model, optimizer = ddp_run(rank, world, "mem-opt", steps=range(SAVE_AT))
    state = optimizer.state_dict()  # right after a decomposition step: the global factors
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": state}, directory / "checkpoint.pt")
    del model, optimizer
    results["freed by reference counting"] = ddp_model_and_kfac_freed_by_reference_counting(rank, world)
    return results


def ddp_model_and_kfac_freed_by_reference_counting(rank: int, world: int) -> dict[str, bool]:
    """Whether a trained DDP model and its ``KFAC`` are gone as soon as the last reference to them
    goes, with the garbage collector off: then the DDP reducer lets go of the process group (and
    gloo its native threads) there, not at some later collection or at interpreter exit."""
    model, optimizer = ddp_run(rank, world, 1.0)
    refs = {"DDP model": weakref.ref(model), "KFAC": weakref.ref(optimizer)}
    gc.disable()
    try:
        del model, optimizer
        return {name: ref() is None for name, ref in refs.items()}
    finally:
        gc.enable()


def async_resumed(rank: int, world: int) -> dict[str, Any]:
    """Async runs saved at SAVE_AT, a round in flight (submitted at step 2; adopted at 4, or at 3
    with AsyncConfig(delay=1)), resumed on fresh models from each rank's own checkpoint or from rank 0's."""
    results: dict[str, Any] = {}
    for delay in (None, 1):
        model, optimizer = ddp_run(rank, world, 1.0, steps=range(SAVE_AT), asynchronous=AsyncConfig(delay=delay))
        buffer = io.BytesIO()
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        ddp_train(model, optimizer, range(SAVE_AT, STEPS), rank, world)
        results[f"params async {delay}"] = parameters(model)
        own = buffer.getvalue()
        shared = [own]
        dist.broadcast_object_list(shared, src=0)
        for source, data in (("own", own), ("rank 0's", shared[0])):
            saved = torch.load(io.BytesIO(data), weights_only=True)
            inner = make_ddp_net()
            inner.load_state_dict(saved["model"])
            model = DDP(inner)
            optimizer = KFAC(model, asynchronous=AsyncConfig(delay=delay),
                             **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
            optimizer.load_state_dict(saved["optimizer"])
            ddp_train(model, optimizer, range(SAVE_AT, STEPS), rank, world)
            results[f"params async {delay} resumed from {source}"] = parameters(model)
    return results


def async_delay_with_a_rank_that_decomposes_nothing(rank: int, world: int) -> dict[str, Any]:
    """One Linear under mem-opt: one rank owns both factors, the other none, yet both must adopt
    (and share) at the delayed adoption step."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(16, 3))
    optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction="mem-opt"), asynchronous=AsyncConfig(delay=1),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    for step in range(4):  # decomposition steps 0 (in line) and 2 (a round, adopted at 3)
        x, y = ddp_shard(step, rank, world)
        optimizer.zero_grad()
        F.cross_entropy(model(x.flatten(1)), y).backward()
        optimizer.step()
    return {"async_delay lone owner": (optimizer.owned_factors, parameters(model))}


def resume(rank: int, world: int, checkpoint: Path, fraction: float | str) -> dict[str, torch.Tensor]:
    saved = torch.load(checkpoint, weights_only=False)
    inner = make_ddp_net()
    inner.load_state_dict(saved["model"])
    model = DDP(inner) if world > 1 else inner
    optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction=fraction),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    optimizer.load_state_dict(saved["optimizer"])
    ddp_train(model, optimizer, range(SAVE_AT, STEPS), rank, world)
    return parameters(model)


def scenario_three_ranks(rank: int, world: int, directory: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for fraction in (1.0, 1 / 3):
        model, _ = ddp_run(rank, world, fraction)
        results[f"params {fraction}"] = parameters(model)
    results["params resumed"] = resume(rank, world, directory / "checkpoint.pt", "mem-opt")
    return results


def ddp_scenario_four_ranks(rank: int, world: int, directory: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for method in ("eigen", "inverse"):
        model, optimizer = ddp_run(rank, world, 0.5, method=method)
        results[f"params {method}"] = parameters(model)
        results[f"decomposed blocks {method}"] = sum(
            block.A.decomposition is not None for block in optimizer.blocks
        )
    return results


# -- the control runs and the ranks' results ----------------------------------------------------


def single_process(steps: int = STEPS, **kwargs: Any) -> tuple[DdpNet, KFAC]:
    model = make_ddp_net()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **{**OPTIONS, **kwargs}})
    ddp_train(model, optimizer, range(steps))
    return model, optimizer


@pytest.fixture(scope="module")
def ddp_two_ranks(module_tmp_path: Path) -> list[dict[str, Any]]:
    return spawn(ddp_scenario_two_ranks, 2, module_tmp_path, deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def three_ranks(module_tmp_path: Path, ddp_two_ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return spawn(scenario_three_ranks, 3, module_tmp_path, deadline_s=DEADLINE_S)  # resumes from the 2-rank checkpoint


@pytest.fixture(scope="module")
def ddp_four_ranks(module_tmp_path: Path) -> list[dict[str, Any]]:
    return spawn(ddp_scenario_four_ranks, 4, module_tmp_path, deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def ddp_reference() -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    return parameters(single_process()[0])


@pytest.mark.parametrize("key", ["comm sums", "comm sums in place"])
def test_bucketed_all_reduce_of_packed_matrices_sums_them_whole(ddp_two_ranks, key: str) -> None:
    expected = [a + b for a, b in zip(symmetric_matrices(0), symmetric_matrices(1), strict=True)]
    for results in ddp_two_ranks:
        assert len(results[key]) == len(expected)
        for actual, want in zip(results[key], expected, strict=True):
            assert actual.dtype == want.dtype
            torch.testing.assert_close(actual, want, rtol=0, atol=0)
    assert all(results["comm sums are the inputs"] for results in ddp_two_ranks)


def test_broadcast_fills_every_rank_with_the_source_tensors(ddp_two_ranks) -> None:
    for results in ddp_two_ranks:
        matrix, vector = results["comm broadcast"]
        assert (matrix == 1).all() and (vector == 1).all() and vector.dtype == torch.float64


def test_communicator_is_a_no_op_on_one_process() -> None:
    communicator = Communicator()
    tensors = symmetric_matrices(0)
    assert not communicator.active and (communicator.rank, communicator.world_size) == (0, 1)
    assert all(a is b for a, b in zip(communicator.all_reduce_sum(tensors, symmetric=True).wait(), tensors))
    assert all(a is b for a, b in zip(communicator.broadcast(tensors, src=0, ranks=(0,)).wait(), tensors))


@pytest.mark.parametrize("fraction", [1.0, "mem-opt"], ids=["comm-opt", "mem-opt"])
def test_two_ranks_equal_one_process_on_the_concatenated_batch(ddp_two_ranks, ddp_reference, fraction) -> None:
    for results in ddp_two_ranks:
        assert_same(results[f"params {fraction}"], ddp_reference)


@pytest.mark.parametrize("fraction", [1.0, 1 / 3], ids=["comm-opt", "mem-opt"])
def test_three_ranks_equal_one_process_on_the_concatenated_batch(three_ranks, ddp_reference, fraction) -> None:
    for results in three_ranks:
        assert_same(results[f"params {fraction}"], ddp_reference)


def test_four_ranks_hybrid_equals_one_process(ddp_four_ranks, ddp_reference) -> None:
    for results in ddp_four_ranks:
        assert_same(results["params eigen"], ddp_reference)


def test_four_ranks_hybrid_inverse_method_equals_one_process(ddp_four_ranks) -> None:
    control = parameters(single_process(method="inverse")[0])
    for results in ddp_four_ranks:
        assert_same(results["params inverse"], control)


def test_hybrid_ranks_hold_decompositions_of_their_own_blocks_only(ddp_four_ranks) -> None:
    held = [results["decomposed blocks eigen"] for results in ddp_four_ranks]
    assert sum(held) == 2 * 4  # 4 blocks, 2 gradient workers each
    assert all(0 < count < 4 for count in held)


def test_two_ranks_with_the_default_intervals_equal_one_process(ddp_two_ranks) -> None:
    """The automatic intervals are counted from each rank's own shapes, without a collective: both
    ranks choose what one process chooses (this net's costs are per-layer overheads, not rows), and
    the run equals the one process's."""
    model, optimizer = single_process(steps=DEFAULT_STEPS, **DEFAULT_INTERVALS)
    for results in ddp_two_ranks:
        assert results["chosen default intervals"] == optimizer.estimator.intervals.chosen
        assert_same(results["params default intervals"], parameters(model))


def test_global_factors_equal_one_process_factors(ddp_two_ranks) -> None:
    _, optimizer = single_process()
    expected = saved_factors(optimizer.state_dict())
    for results in ddp_two_ranks:
        assert_same(results["factors 1.0"], expected)


@pytest.mark.parametrize(("fraction", "method"), MODERN_RUNS)
def test_two_ranks_equal_one_process_with_embedding_attention_grouped_and_nd_conv_blocks(
    ddp_two_ranks, fraction, method
) -> None:
    model = make_ddp_net(modern=True)
    optimizer = KFAC(model, method=method, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    assert len(optimizer.blocks) == 7
    ddp_train(model, optimizer, range(STEPS))
    for results in ddp_two_ranks:
        assert_same(results[f"modern params {fraction} {method}"], parameters(model))
        assert_same(results[f"modern factors {fraction} {method}"], saved_factors(optimizer.state_dict()))
    first, second = ddp_two_ranks
    assert_same(first[f"modern params {fraction} {method}"],
                second[f"modern params {fraction} {method}"], rtol=0, atol=0)


@pytest.mark.parametrize("fraction", [1.0, "mem-opt"], ids=["comm-opt", "mem-opt"])
def test_two_ranks_with_the_eigenbasis_cap_equal_one_process(ddp_two_ranks, fraction) -> None:
    model, optimizer = single_process(method=CAPPED)
    truncated = [f"{b.name}.{n}" for b in optimizer.blocks for n, f in b.factors.items()
                 if f.decomposition.complement is not None and float(f.decomposition.complement) > 0]
    assert "fc1.A" in truncated, truncated  # the cap binds: the comparison is about truncated factors
    for results in ddp_two_ranks:
        assert_same(results[f"params capped {fraction}"], parameters(model))


def test_lazy_and_eager_reduction_give_the_same_factors(ddp_two_ranks) -> None:
    for results in ddp_two_ranks:
        assert_same(results["factors 1.0"], results["factors eager"])


def test_no_sync_accumulation_equals_one_large_batch(ddp_two_ranks, ddp_reference) -> None:
    for results in ddp_two_ranks:
        assert_same(results["params no_sync"], ddp_reference)


def test_async_decompositions_under_ddp_equal_one_process_with_the_shards_as_micro_batches(ddp_two_ranks) -> None:
    """Each rank adopts the worker's round at the same step; owners broadcast what they adopted."""
    model = make_ddp_net()
    optimizer = KFAC(model, asynchronous=AsyncConfig(), **{"factor_update_steps": 1, "decomposition_update_steps": 10,
                                                           **OPTIONS})
    ddp_train(model, optimizer, range(STEPS), micro_batches=2)
    for results in ddp_two_ranks:
        assert_same(results["params async"], parameters(model))
    synchronous = make_ddp_net()
    ddp_train(synchronous, KFAC(synchronous, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS}),
              range(STEPS), micro_batches=2)
    # Stale by one refresh from step 4 on (rounds: step 0 in line, submitted at 2, adopted at 4).
    assert not torch.allclose(parameters(model)["fc1.weight"], parameters(synchronous)["fc1.weight"], rtol=1e-4)


@pytest.mark.parametrize("delay", [None, 1])
def test_async_run_resumed_from_each_ranks_checkpoint_continues_bit_identically(
    ddp_two_ranks, delay: int | None
) -> None:
    """Each rank saved the round in flight it computed; a checkpoint of rank 0 loaded on every rank
    adopts at the same step on every rank (no hang), and the ranks stay bit-identical."""
    for results in ddp_two_ranks:
        assert_same(results[f"params async {delay} resumed from own"], results[f"params async {delay}"], rtol=0, atol=0)
    if delay is None:
        assert_same(ddp_two_ranks[0]["params async None"], ddp_two_ranks[0]["params async"], rtol=0, atol=0)
    first, second = ddp_two_ranks
    key = f"params async {delay} resumed from rank 0's"
    assert_same(first[key], second[key], rtol=0, atol=0)


def test_async_delay_adopts_on_every_rank_when_one_rank_decomposes_nothing(ddp_two_ranks) -> None:
    """The adopt step shares decompositions (a collective): a rank without a job of its own must
    take part too (it used to skip it, and the ranks timed out)."""
    (owned_0, params_0), (owned_1, params_1) = (results["async_delay lone owner"] for results in ddp_two_ranks)
    assert sorted([len(owned_0), len(owned_1)]) == [0, 2]  # A and G on one rank
    assert_same(params_0, params_1, rtol=0, atol=0)


def test_async_statistics_under_ddp_are_bit_identical_to_in_line(ddp_two_ranks) -> None:
    """The worker runs the same statistics work in the same order: each rank's factors and parameters
    equal, bit for bit, those of its own run with the statistics in line."""
    for results in ddp_two_ranks:
        assert_same(results["params async statistics"], results["params async"], rtol=0, atol=0)
        assert_same(results["factors async statistics"], results["factors async"], rtol=0, atol=0)


def test_staggered_factor_updates_under_ddp_equal_one_process(ddp_two_ranks) -> None:
    """The ranks sum their statistics costs, so they assign the phases one process assigns."""
    model, optimizer = single_process(**STAGGER)
    factors = saved_factors(optimizer.state_dict())
    for results in ddp_two_ranks:
        assert_same(results["params stagger"], parameters(model))
        assert_same(results["factors stagger"], factors)
    unstaggered = saved_factors(single_process(factor_update_steps=3)[1].state_dict())
    assert any(not torch.allclose(factors[key], unstaggered[key]) for key in factors)


def test_sampled_fisher_under_ddp_equals_one_process_with_the_shards_as_micro_batches(ddp_two_ranks) -> None:
    """Each rank draws targets for its shard; one process drawing the same per shard agrees."""
    model = make_ddp_net()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS,
                               "curvature": CurvatureConfig(factor_decay=0.9, fisher="sampled")})
    ddp_train(model, optimizer, range(STEPS), micro_batches=2)
    factors = saved_factors(optimizer.state_dict())
    for results in ddp_two_ranks:
        assert_same(results["params sampled"], parameters(model))
        assert_same(results["factors sampled"], factors)
    empirical = saved_factors(single_process()[1].state_dict())
    assert not torch.allclose(factors["head.G"], empirical["head.G"], rtol=1e-2)


@pytest.mark.parametrize(
    ("world", "key"),
    [("ddp_two_ranks", "params 1.0"), ("ddp_two_ranks", "params mem-opt"), ("ddp_two_ranks", "params sampled"),
     ("ddp_two_ranks", "params async"), ("ddp_two_ranks", "params async statistics"),
     ("ddp_two_ranks", "params stagger"),
     ("ddp_two_ranks", "params capped 1.0"), ("ddp_two_ranks", "params capped mem-opt"),
     ("three_ranks", "params 1.0"), ("three_ranks", f"params {1 / 3}"), ("three_ranks", "params resumed"),
     ("ddp_four_ranks", "params eigen"), ("ddp_four_ranks", "params inverse")],
)
def test_ranks_hold_bit_identical_parameters(request: pytest.FixtureRequest, world: str, key: str) -> None:
    """DDP's premise: ranks never drift apart, not even by one rounding (a received decomposition
    must precondition exactly as its owner's copy does)."""
    first, *others = request.getfixturevalue(world)
    for other in others:
        assert_same(other[key], first[key], rtol=0, atol=0)


def test_receivers_take_new_decompositions_into_the_storage_of_the_old_ones(ddp_two_ranks) -> None:
    for results in ddp_two_ranks:
        storage = results["received decomposition storage"]
        assert storage[0], "this rank received no decomposition"
        # Decomposition steps 0, 2, 4 (decomposition_update_steps=2). A thin Q (linalg.symmetric_eigen) may
        # change shape while the factor's rank grows; a Q of the shape held reuses its storage.
        reused = 0
        for before, after in ((storage[0], storage[2]), (storage[2], storage[4])):
            assert before.keys() == after.keys()
            for key, (pointer, shape) in after.items():
                if shape == before[key][1]:
                    assert pointer == before[key][0], key
                    reused += 1
        assert reused >= len(storage[0])  # at least one step's worth of reuse


def test_a_ddp_model_and_its_kfac_are_freed_when_the_last_reference_goes(ddp_two_ranks) -> None:
    """No reference cycle through ``KFAC``: a spawned rank that returns from its training function
    releases the DDP model's process group there (a cycle kept it, with gloo's threads running, until
    interpreter exit, where a rank could abort with "terminate called without an active exception")."""
    for result in ddp_two_ranks:
        assert result["freed by reference counting"] == {"DDP model": True, "KFAC": True}


def test_unused_and_rank_dependent_layers_do_not_hang_and_ranks_agree(ddp_two_ranks) -> None:
    first, second = ddp_two_ranks
    assert_same(first["params unused"], second["params unused"], rtol=0, atol=0)
    assert_same(first["factors unused"], second["factors unused"], rtol=0, atol=0)
    assert not first["factors unused"]["unused.A"].any()


def test_memory_opt_holds_fewer_decomposition_bytes(ddp_two_ranks) -> None:
    for results in ddp_two_ranks:
        comm_opt, mem_opt = results["memory 1.0"], results["memory mem-opt"]
        assert comm_opt["factors"] == mem_opt["factors"] > 0
        assert 0 < mem_opt["decompositions"] < comm_opt["decompositions"]
        assert comm_opt["total"] == sum(v for k, v in comm_opt.items() if k != "total")


def test_checkpoint_saved_on_rank_zero_under_mem_opt_holds_every_layer(ddp_two_ranks, module_tmp_path) -> None:
    state = torch.load(module_tmp_path / "checkpoint.pt", weights_only=False)["optimizer"]
    decompositions = [
        factor["decomposition"] for block in state["kfac"]["blocks"].values() for factor in block["factors"].values()
    ]
    assert any(d is None for d in decompositions) and any(d is not None for d in decompositions)
    _, optimizer = single_process(steps=SAVE_AT)
    assert_same(saved_factors(state), saved_factors(optimizer.state_dict()))


def test_two_rank_checkpoint_resumes_on_one_process(ddp_two_ranks, module_tmp_path, ddp_reference) -> None:
    assert_same(resume(0, 1, module_tmp_path / "checkpoint.pt", 1.0), ddp_reference)


def test_two_rank_checkpoint_resumes_on_three_ranks(three_ranks, ddp_reference) -> None:
    for results in three_ranks:
        assert_same(results["params resumed"], ddp_reference)


def test_single_process_ignores_the_fraction_and_holds_every_decomposition() -> None:
    model, optimizer = single_process(runtime=RuntimeConfig(grad_worker_fraction="mem-opt"))
    assert all(f.decomposition is not None for block in optimizer.blocks for f in block.factors.values())
    assert_same(parameters(model), parameters(single_process()[0]), rtol=0, atol=0)


