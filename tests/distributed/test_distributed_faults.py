"""Distributed K-FAC when ranks part ways (docs/design.md §5, "When ranks part ways"): mismatched settings,
uneven inputs under ``Join``, ``state_dict()`` called on one rank only (never a collective), a rank that dies.

One spawn of 2 real gloo ranks runs every scenario in turn (the cheap, group-preserving ones
first) and saves what each rank saw; the tests read it in this process. Scenarios that could
break a process group run on a group of their own with a short timeout: ``state_dict()`` on one
rank (a collective there would fail fast), then, last, a rank that dies in the middle of a step.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from kfac_optim import KFAC, AsyncConfig, CurvatureConfig, RuntimeConfig
from kfac_optim.schedule.milestones import MilestoneSchedule
from tests.distributed.test_distributed import STEPS, ddp_train, make_ddp_net, parameters, saved_factors
from tests.distributed_helpers import load_results, results_file, run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

WORLD = 2
DEADLINE_S = 120.0
GROUP_TIMEOUT_S = 30.0  # the default group: generous, a loaded box is slow
FAULT_TIMEOUT_S = 5.0  # the groups that are broken on purpose
OPTIONS: dict[str, Any] = dict(lr=0.1, momentum=0.9, damping=0.1, kl_clip=1e-2,
                               curvature=CurvatureConfig(factor_decay=0.9), decomposition_update_steps=2)
JOIN_BATCHES = (6, 4)  # per rank: rank 1 runs out of inputs two steps early
DEAD_RANK_EXIT_CODE = 17


def outcome(action: Callable[[], object]) -> str:
    """"ok", or the type and message of what ``action`` raised."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 (the tests look at which exception and what it says)
        return f"{type(error).__name__}: {error}"
    return "ok"


class Wide(nn.Module):
    """Same layer names as ``Net`` in test_distributed for fc1/fc2, another width."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, hidden)
        self.fc2 = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


# per rank: (model factory, KFAC keyword arguments); rank r uses entry r
MISMATCHES: dict[str, tuple[tuple[Callable[[], nn.Module], dict[str, Any]], ...]] = {
    "damping": ((make_ddp_net, dict(damping=0.1)), (make_ddp_net, dict(damping=0.2))),
    "decomposition_update_steps": ((make_ddp_net, dict(decomposition_update_steps=10)),
                                   (make_ddp_net, dict(decomposition_update_steps=5))),
    "method": ((make_ddp_net, dict(method="eigen")), (make_ddp_net, dict(method="inverse"))),
    "factor_dtype": ((make_ddp_net, {}), (make_ddp_net, dict(curvature=CurvatureConfig(factor_dtype=torch.float64)))),
    "grad_worker_fraction": ((make_ddp_net, dict(runtime=RuntimeConfig(grad_worker_fraction=1.0))),
                             (make_ddp_net, dict(runtime=RuntimeConfig(grad_worker_fraction="mem-opt")))),
    "damping schedule": (
        (make_ddp_net, dict(damping=MilestoneSchedule(0.1, milestones=(100,), gamma=0.5))),
        (make_ddp_net, dict(damping=MilestoneSchedule(0.1, milestones=(200,), gamma=0.5))),
    ),
    "skip_layers": ((make_ddp_net, {}), (make_ddp_net, dict(curvature=CurvatureConfig(skip_layers=["fc2"])))),
    "asynchronous": ((make_ddp_net, {}), (make_ddp_net, dict(asynchronous=AsyncConfig()))),
    "asynchronous.delay": (
        (make_ddp_net, dict(asynchronous=AsyncConfig(delay=1))),
        (make_ddp_net, dict(asynchronous=AsyncConfig(delay=2))),
    ),
    "layer shapes": ((lambda: Wide(8), {}), (lambda: Wide(9), {})),
    "same settings spelled differently": (
        (make_ddp_net, dict(runtime=RuntimeConfig(grad_worker_fraction="comm-opt"),
                            damping=MilestoneSchedule(0.1, milestones=(100,)))),
        # async_statistics changes no result (the same factors, computed later): ranks may differ in it
        (make_ddp_net, dict(runtime=RuntimeConfig(grad_worker_fraction=1.0, async_statistics=True),
                            damping=MilestoneSchedule(0.1, milestones=(100,)))),
    ),
}


# -- what the ranks do --------------------------------------------------------------------------


def saved_factor_copies(optimizer: KFAC, synchronize: bool = True) -> dict[str, torch.Tensor]:
    """A copy of the factors ``state_dict()`` saves (later steps update them in place), made
    global first (``synchronize_factors()``, a collective) unless ``synchronize`` is False."""
    if synchronize:
        optimizer.synchronize_factors()
    return {key: factor.clone() for key, factor in saved_factors(optimizer.state_dict()).items()}


def mismatched_settings(rank: int) -> dict[str, str]:
    results = {}
    for case, per_rank in MISMATCHES.items():
        factory, kwargs = per_rank[rank]
        results[case] = outcome(
            lambda: KFAC(factory(), lr=0.1, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **kwargs}))  # noqa: B023 (called at once)
    return results


def state(model: nn.Module, optimizer: KFAC) -> dict[str, Any]:
    """What must agree across ranks: parameters, steps, global factors, decompositions, momentum."""
    decompositions = {
        f"{block.name}.{name}": factor.decomposition.Q.clone()
        for block in optimizer.blocks for name, factor in block.factors.items() if factor.decomposition is not None
    }
    names = {p: n for n, p in (model.module if isinstance(model, DDP) else model).named_parameters()}
    momentum = {names[p]: s["momentum_buffer"].clone() for p, s in optimizer.state.items() if "momentum_buffer" in s}
    return {
        "params": parameters(model),
        "steps": optimizer.steps,
        "factors": saved_factor_copies(optimizer),  # synchronize_factors() on every rank
        "decompositions": decompositions,
        "momentum": momentum,
    }


def uneven_inputs(rank: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    model = DDP(make_ddp_net())
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    with Join([model, optimizer]):
        ddp_train(model, optimizer, range(JOIN_BATCHES[rank]), rank, WORLD)
    results["joined"] = state(model, optimizer)
    ddp_train(model, optimizer, range(6, 9), rank, WORLD)  # an even epoch after: the ranks stay identical
    results["after"] = state(model, optimizer)

    model = DDP(make_ddp_net())
    optimizer = KFAC(model, runtime=RuntimeConfig(grad_worker_fraction="mem-opt"),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    results["refused mem-opt"] = outcome(lambda: Join([model, optimizer]))
    model = DDP(make_ddp_net())
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})

    def optimizer_first() -> None:
        with Join([optimizer, model]):
            ddp_train(model, optimizer, range(JOIN_BATCHES[rank]), rank, WORLD)

    results["refused optimizer first"] = outcome(optimizer_first)
    model = DDP(make_ddp_net())
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})

    def model_only() -> None:
        with Join([model]):
            ddp_train(model, optimizer, range(JOIN_BATCHES[rank]), rank, WORLD)

    results["refused model only"] = outcome(model_only)
    return results


def state_dict_on_rank_zero(rank: int, directory: Path) -> dict[str, Any]:
    """The habit ``if rank == 0: torch.save(optimizer.state_dict())``, with the ranks then going on:
    rank 0 saves right after decomposition step 2 and after factor step 3 (rank 1 never calls
    ``state_dict()``), both train to ``STEPS``, then both resume from each checkpoint."""
    results: dict[str, Any] = {}
    group = dist.new_group(timeout=timedelta(seconds=FAULT_TIMEOUT_S))  # short: a mismatch fails fast
    for fraction in (1.0, "mem-opt"):
        model = DDP(make_ddp_net(), process_group=group)
        optimizer = KFAC(model, runtime=RuntimeConfig(process_group=group, grad_worker_fraction=fraction),
                         **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
        ddp_train(model, optimizer, range(3), rank, WORLD)  # step 2 decomposed: the factors are global
        if fraction == 1.0:
            if rank == 0:
                results["right after a decomposition step"] = saved_factor_copies(optimizer, synchronize=False)
            dist.barrier()  # on the default group: rank 1 waits until rank 0 saved
            results["on every rank"] = saved_factor_copies(optimizer)
        checkpoints = {"decomposition step": directory / f"rank0-{fraction}-2.pt",
                       "factor step": directory / f"rank0-{fraction}-3.pt"}
        if rank == 0:
            save_rank_checkpoint(model, optimizer, checkpoints["decomposition step"])
        ddp_train(model, optimizer, range(3, 4), rank, WORLD)  # step 3 folds only: the factors are local
        if rank == 0:  # (a collective here would wait for rank 1 up to the store's timeout: shortened)
            store = dist.group.WORLD.get_group_store()
            store.set_timeout(timedelta(seconds=FAULT_TIMEOUT_S))
            results[f"saved after a factor step {fraction}"] = outcome(
                lambda: save_rank_checkpoint(model, optimizer, checkpoints["factor step"]))  # noqa: B023 (called at once)
            store.set_timeout(timedelta(seconds=GROUP_TIMEOUT_S))
        went_on = outcome(lambda: ddp_train(model, optimizer, range(4, STEPS), rank, WORLD))  # noqa: B023
        dist.barrier()  # on the default group: the checkpoints are written
        if went_on != "ok" or not all(path.exists() for path in checkpoints.values()):
            results[f"went on {fraction}"] = went_on
            return results
        results[f"params {fraction}"] = parameters(model)
        for when, path in checkpoints.items():
            resumed = resume_checkpoint(path, fraction, group, rank, WORLD)
            results[f"resumed from the {when} {fraction}"] = parameters(resumed)
    return results


def save_rank_checkpoint(model: nn.Module, optimizer: KFAC, path: Path) -> None:
    """Model and ``optimizer.state_dict()`` through ``torch.save``, as DDP scripts do on rank 0."""
    inner = model.module if isinstance(model, DDP) else model
    torch.save({"model": inner.state_dict(), "optimizer": optimizer.state_dict()}, path)


def resume_checkpoint(path: Path, fraction: float | str, group: Any, rank: int, world: int) -> nn.Module:
    """A fresh model and optimizer loaded from ``path`` (saved after step ``int(path.stem[-1])``),
    trained on to ``STEPS``: under DDP on ``group`` with ``world > 1``, else in one process."""
    saved = torch.load(path, weights_only=True)
    inner = make_ddp_net()
    inner.load_state_dict(saved["model"])
    model = DDP(inner, process_group=group) if world > 1 else inner
    optimizer = KFAC(model, runtime=RuntimeConfig(process_group=group, grad_worker_fraction=fraction),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    optimizer.load_state_dict(saved["optimizer"])
    ddp_train(model, optimizer, range(int(path.stem[-1]) + 1, STEPS), rank, world)
    return model


def dead_peer(rank: int, directory: Path, results: dict[str, Any]) -> dict[str, Any]:
    """Rank 1 dies inside a step (after saving ``results``, the other scenarios'); rank 0 must raise
    from K-FAC's collective within the timeout."""
    group = dist.new_group(timeout=timedelta(seconds=FAULT_TIMEOUT_S))
    model = DDP(make_ddp_net(), process_group=group)
    optimizer = KFAC(model, runtime=RuntimeConfig(process_group=group),
                     **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    ddp_train(model, optimizer, range(4), rank, WORLD)
    if rank == 1:  # dies as step 4, a decomposition step, begins
        torch.save(results, results_file(directory, every_fault, rank))
        optimizer.register_step_pre_hook(lambda *_: os._exit(DEAD_RANK_EXIT_CODE))
    start = time.monotonic()
    raised = outcome(lambda: ddp_train(model, optimizer, range(4, 6), rank, WORLD))
    return {"raised": raised, "seconds": time.monotonic() - start}


def every_fault(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """The scenarios in turn, each one's result or traceback (``dead peer`` breaks the default group)."""
    results: dict[str, Any] = {}
    scenarios: dict[str, Callable[[], Any]] = {
        "mismatch": lambda: mismatched_settings(rank),
        "join": lambda: uneven_inputs(rank),
        "state_dict": lambda: state_dict_on_rank_zero(rank, directory),
        "dead peer": lambda: dead_peer(rank, directory, results),
    }
    for name, scenario in scenarios.items():
        try:
            results[name] = scenario()
        except Exception:  # noqa: BLE001 (reported by that scenario's tests, with this traceback)
            results[name] = {"error": traceback.format_exc()}
        if name != "dead peer":
            dist.barrier()
    return results


@pytest.fixture(scope="module")
def ranks(module_tmp_path: Path) -> list[dict[str, Any]]:
    """Every rank's results (rank 1's as saved right before it died)."""
    exit_codes = run_ranks(
        every_fault, WORLD, module_tmp_path, deadline_s=DEADLINE_S, group_timeout_s=GROUP_TIMEOUT_S,
        exit_codes=(0, DEAD_RANK_EXIT_CODE), abandon_group=True,
    )
    results = load_results(every_fault, WORLD, module_tmp_path)
    for result, exit_code in zip(results, exit_codes, strict=True):
        result["exit code"] = exit_code
    return results


def scenario(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """Every rank's results of scenario ``name``; a failure with the traceback if it raised."""
    for rank, results in enumerate(ranks):
        assert name in results, f"rank {rank} did not run {name!r}"
        assert "error" not in results[name], f"rank {rank}, {name!r}:\n{results[name]['error']}"
    return [results[name] for results in ranks]


def assert_identical(first: Any, second: Any, what: str) -> None:
    if isinstance(first, dict):
        assert first.keys() == second.keys(), what
        for key in first:
            assert_identical(first[key], second[key], f"{what}/{key}")
    elif isinstance(first, torch.Tensor):
        torch.testing.assert_close(first, second, rtol=0, atol=0, msg=what)
    else:
        assert first == second, what


# -- 10: mismatched settings ---------------------------------------------------------------------


@pytest.mark.parametrize("case", [c for c in MISMATCHES if c != "same settings spelled differently"])
def test_mismatched_settings_raise_on_every_rank_naming_the_option_and_the_ranks(ranks, case: str) -> None:
    option = {"damping schedule": "damping", "skip_layers": "layers", "layer shapes": "layers"}.get(case, case)
    for rank, results in enumerate(scenario(ranks, "mismatch")):
        message = results[case]
        assert message.startswith("ValueError: KFAC settings differ across ranks"), message
        assert f"{option} " in message and "ranks [0]" in message and "ranks [1]" in message, message
        assert f"this is rank {rank}" in message


def test_mismatched_layer_list_names_the_first_differing_layer(ranks) -> None:
    results = scenario(ranks, "mismatch")[0]
    message = results["layer shapes"]
    assert "'fc1': Linear weight (8, 16)" in message and "'fc1': Linear weight (9, 16)" in message, message
    message = results["skip_layers"]
    assert "rank 0: 4 entries, rank 1: 3 entries" in message, message


def test_equivalent_settings_pass_the_check(ranks) -> None:
    for results in scenario(ranks, "mismatch"):
        assert results["same settings spelled differently"] == "ok"


# -- 11: uneven inputs under Join ----------------------------------------------------------------


def test_join_with_uneven_inputs_leaves_identical_ranks(ranks) -> None:
    first, second = (results["joined"] for results in scenario(ranks, "join"))
    assert first["steps"] == second["steps"] == max(JOIN_BATCHES)
    assert first["decompositions"] and first["momentum"]
    assert_identical(first, second, "after Join")


def test_ranks_stay_identical_when_training_goes_on_after_join(ranks) -> None:
    first, second = (results["after"] for results in scenario(ranks, "join"))
    assert_identical(first, second, "after Join and three more steps")
    before = scenario(ranks, "join")[0]["joined"]["params"]
    assert not torch.equal(first["params"]["fc1.weight"], before["fc1.weight"])


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("refused mem-opt", "ValueError: KFAC under Join needs RuntimeConfig(grad_worker_fraction=1)"),
        ("refused optimizer first", "ValueError: Join: pass the DDP model before the KFAC optimizer"),
        ("refused model only", "ValueError: the DDP model runs under Join but its KFAC optimizer does not"),
    ],
)
def test_join_uses_kfac_cannot_shadow_are_refused_on_every_rank(ranks, key: str, expected: str) -> None:
    for results in scenario(ranks, "join"):
        assert results[key].startswith(expected), results[key]


# -- 12: state_dict() on one rank only ------------------------------------------------------------


def test_state_dict_right_after_a_decomposition_step_needs_no_other_rank(ranks) -> None:
    results = scenario(ranks, "state_dict")
    alone = results[0]["right after a decomposition step"]
    for result in results:
        assert_identical(result["on every rank"], alone, "factors")


@pytest.mark.parametrize("fraction", [1.0, "mem-opt"])
def test_state_dict_on_rank_zero_only_never_communicates_and_resumes_on_two_ranks(ranks, fraction) -> None:
    """Rank 0 alone saves after a factor step (rank 1 never calls ``state_dict()``; a collective
    would time out): it returns, and both checkpoints resume on 2 ranks. The one saved right after
    a decomposition step continues bit-identically with the uninterrupted run; the other holds
    rank 0's statistics of step 3 only, and the ranks resumed from it stay identical."""
    first, second = scenario(ranks, "state_dict")
    assert first[f"saved after a factor step {fraction}"] == "ok", first
    assert f"params {fraction}" in first and f"params {fraction}" in second, (first, second)
    for results in (first, second):
        assert_identical(results[f"resumed from the decomposition step {fraction}"], results[f"params {fraction}"],
                         "resumed from the decomposition step")
    assert_identical(first[f"resumed from the factor step {fraction}"],
                     second[f"resumed from the factor step {fraction}"],
                     "ranks resumed from the factor step")
    assert all(torch.isfinite(p).all() for p in first[f"resumed from the factor step {fraction}"].values())


@pytest.mark.parametrize("fraction", [1.0, "mem-opt"])
def test_rank_zero_checkpoint_resumes_on_one_process(ranks, module_tmp_path, fraction) -> None:
    """The same checkpoints in one process on the whole batch: from the decomposition step it
    equals the uninterrupted 2-rank run (as one process equals two ranks: to rounding); from the
    factor step it resumes, the factors of rank 0 standing for both ranks'."""
    torch.set_num_threads(1)
    first, _ = scenario(ranks, "state_dict")
    from_decomposition = resume_checkpoint(module_tmp_path / f"rank0-{fraction}-2.pt", fraction, None, 0, 1)
    for name, param in parameters(from_decomposition).items():
        torch.testing.assert_close(param, first[f"params {fraction}"][name], rtol=1e-4, atol=1e-6, msg=name)
    from_factor_step = resume_checkpoint(module_tmp_path / f"rank0-{fraction}-3.pt", fraction, None, 0, 1)
    assert all(torch.isfinite(p).all() for p in from_factor_step.parameters())


# -- 13: a rank that dies ------------------------------------------------------------------------


def test_survivor_of_a_dead_peer_raises_from_kfac_within_the_timeout(ranks) -> None:
    assert [results["exit code"] for results in ranks] == [0, DEAD_RANK_EXIT_CODE]
    assert "dead peer" not in ranks[1]  # it died inside that step
    survivor = scenario(ranks[:1], "dead peer")[0]
    assert "KFAC.step(): the all-reduce of the running factors failed on rank 0 of 2" in survivor["raised"], survivor
    assert survivor["seconds"] < FAULT_TIMEOUT_S + 2.0
