"""Real gloo (or NCCL) ranks for the distributed tests: spawn them, wait with a deadline, read what they saved.

A scenario is a module-level function ``scenario(rank, world, directory) -> dict`` (the spawned
ranks import its module afresh, so it must be picklable by name). Each rank runs single-threaded
in a gloo process group of ``world`` ranks (file:// rendezvous in ``directory``; ``backend="nccl"``:
an NCCL group, rank ``r`` on CUDA device ``r``), runs the
scenario and saves the dict it returns in ``directory``; the test process loads every rank's dict.
A hang fails the test at the deadline instead of blocking the suite, and a rank that raises (or
exits with a code the caller does not expect) fails it at once, with that rank's traceback.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Scenario = Callable[[int, int, Path], dict[str, Any]]


def results_file(directory: Path, scenario: Scenario, rank: int) -> Path:
    """Where rank ``rank`` saves what ``scenario`` returned (a scenario may save there early itself)."""
    return directory / f"{scenario.__name__}-{rank}.pt"


def _traceback_file(directory: Path, scenario: Scenario, rank: int) -> Path:
    return directory / f"{scenario.__name__}-{rank}.traceback"


def _rank_main(rank: int, world: int, scenario: Scenario, directory: str, group_timeout_s: float,
               abandon_group: bool, backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    path = Path(directory)
    dist.init_process_group(
        backend,
        init_method=f"file://{path / f'rendezvous-{scenario.__name__}'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=group_timeout_s),
    )
    try:
        torch.save(scenario(rank, world, path), results_file(path, scenario, rank))
        exit_code = 0
    except BaseException:  # noqa: BLE001 (the test process reports it, with this traceback)
        _traceback_file(path, scenario, rank).write_text(traceback.format_exc())
        exit_code = 1
    gc.collect()  # free DDP reducers and collectives' work objects while the group and Python are alive
    if abandon_group:
        os._exit(exit_code)  # a peer is dead on purpose: do not wait for it in destroy_process_group
    dist.destroy_process_group()
    sys.exit(exit_code)


def run_ranks(
    scenario: Scenario,
    world: int,
    directory: Path,
    *,
    deadline_s: float,
    group_timeout_s: float | None = None,
    exit_codes: Collection[int] = (0,),
    abandon_group: bool = False,
    backend: str = "gloo",
) -> list[int]:
    """Run ``scenario`` on ``world`` spawned ranks of ``backend`` ("gloo" or "nccl"); their exit codes, rank by rank.

    ``group_timeout_s`` (default: half the deadline) bounds each collective of the default group.
    The test fails when the ranks are not all done ``deadline_s`` after the start, or as soon as
    one exits with a code outside ``exit_codes``; either way the other ranks are killed.
    ``abandon_group``: the ranks leave without destroying the group (for a scenario that kills a rank).
    """
    group_timeout_s = deadline_s / 2 if group_timeout_s is None else group_timeout_s
    context = mp.get_context("spawn")
    processes = [
        context.Process(target=_rank_main, args=(rank, world, scenario, str(directory), group_timeout_s, abandon_group, backend))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + deadline_s
    while True:
        alive = [p for p in processes if p.is_alive()]
        failed = [rank for rank, p in enumerate(processes) if p.exitcode is not None and p.exitcode not in exit_codes]
        if not alive or failed or time.monotonic() > deadline:
            break
        wait([p.sentinel for p in alive], timeout=max(0.0, min(1.0, deadline - time.monotonic())))
    for process in alive:
        process.kill()
        process.join()
    if failed:
        rank = failed[0]
        saved = _traceback_file(directory, scenario, rank)
        why = saved.read_text() if saved.exists() else "(no traceback saved)"
        pytest.fail(f"rank {rank} of {world} in {scenario.__name__} exited with code {processes[rank].exitcode}:\n{why}")
    if alive:
        pytest.fail(f"{world} ranks of {scenario.__name__} did not finish in {deadline_s:.0f} s")
    return [process.exitcode for process in processes]


def load_results(scenario: Scenario, world: int, directory: Path) -> list[dict[str, Any]]:
    """What every rank of ``scenario`` saved, rank by rank."""
    return [torch.load(results_file(directory, scenario, rank), weights_only=False) for rank in range(world)]


def spawn(scenario: Scenario, world: int, directory: Path, *, deadline_s: float, backend: str = "gloo") -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` ranks of ``backend`` (``run_ranks``); every rank's results."""
    run_ranks(scenario, world, directory, deadline_s=deadline_s, backend=backend)
    return load_results(scenario, world, directory)


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    """The same keys, and every tensor close to the expected one (``rtol=atol=0``: bit-identical)."""
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=rtol, atol=atol, msg=key)
