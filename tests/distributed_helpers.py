"""Real gloo (or NCCL) ranks for the distributed tests: spawn them, wait with a deadline, read what they saved.

A scenario is a module-level function ``scenario(rank, world, directory) -> dict`` (the spawned
ranks import its module afresh, so it must be picklable by name). Each rank runs single-threaded
in a gloo process group of ``world`` ranks (file:// rendezvous in ``directory``; ``backend="nccl"``:
an NCCL group, rank ``r`` on CUDA device ``r``), runs the
scenario and saves the dict it returns in ``directory``; the test process loads every rank's dict.
A hang fails the test at the deadline instead of blocking the suite, and a rank that raises (or
exits with a code the caller does not expect) fails it at once, with that rank's traceback.

gloo ranks are forked from one server process that imported torch and kfac_optim once (``_rank_context``).
``spawn`` on gloo ranks of a world in ``POOLED_WORLDS`` reuses those processes: one pool of
``world`` processes, started on first use, runs every such scenario of the session, each in a
process group of its own (created for it, destroyed after it), from a fresh process's seed, thread
count, default dtype, grad mode and warning filters. A process start costs seconds of imports;
the scenarios need a fresh group, not a fresh interpreter. A failed or late scenario kills its pool
(the next one starts a new pool). ``close_pools`` ends them (tests/conftest.py: the 2-rank pool with
the session, larger ones, about 0.4 GB a rank, when the tests leave the folder that used them).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Collection
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Scenario = Callable[[int, int, Path], dict[str, Any]]

PRELOADED = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "kfac_optim"]
"""What the gloo ranks' fork server imports once (``torch._dynamo``: any optimizer's construction
does): a spawned process spent about 6 s of CPU importing these, a forked one nothing."""


def _rank_context(backend: str) -> BaseContext:
    """gloo ranks: forked from one server process that imported :data:`PRELOADED` (not from the test
    process, whose threads and state a fork would copy); NCCL ranks (CUDA) are spawned."""
    if backend != "gloo":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return context


def results_file(directory: Path, scenario: Scenario, rank: int) -> Path:
    """Where rank ``rank`` saves what ``scenario`` returned (a scenario may save there early itself)."""
    return directory / f"{scenario.__name__}-{rank}.pt"


def _traceback_file(directory: Path, scenario: Scenario, rank: int) -> Path:
    return directory / f"{scenario.__name__}-{rank}.traceback"


def _run_scenario(rank: int, world: int, scenario: Scenario, path: Path, group_timeout_s: float, backend: str) -> int:
    """Create the group, run ``scenario`` and save what it returns (or its traceback); 0, or 1 if it raised.
    The group is left for the caller to destroy."""
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
    return exit_code


def _rank_main(rank: int, world: int, scenario: Scenario, directory: str, group_timeout_s: float,
               abandon_group: bool, backend: str) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    exit_code = _run_scenario(rank, world, scenario, Path(directory), group_timeout_s, backend)
    if abandon_group:
        os._exit(exit_code)  # a peer is dead on purpose: do not wait for it in destroy_process_group
    dist.destroy_process_group()
    sys.exit(exit_code)


def _pooled_rank_main(rank: int, world: int, connection: Connection) -> None:
    """One rank of a pool: run each ``(scenario, directory, group_timeout_s)`` received, in a gloo
    group of its own and from a fresh process's state; answer its exit code; leave when the
    connection closes (the test process is gone)."""
    fresh_seed, fresh_dtype = torch.initial_seed(), torch.get_default_dtype()
    while True:
        try:
            scenario, directory, group_timeout_s = connection.recv()
        except EOFError:
            return
        torch.manual_seed(fresh_seed)
        torch.set_num_threads(1)
        torch.set_default_dtype(fresh_dtype)
        torch.set_grad_enabled(True)
        with warnings.catch_warnings():
            exit_code = _run_scenario(rank, world, scenario, Path(directory), group_timeout_s, "gloo")
        dist.destroy_process_group()
        connection.send(exit_code)
        if exit_code:
            return


POOLED_WORLDS = (2, 4)  # the world sizes more than one scenario of the suite runs on (3: one scenario)


class _RankPool:
    """``world`` spawned processes that run scenarios one after another (``_pooled_rank_main``)."""

    def __init__(self, world: int) -> None:
        context = _rank_context("gloo")
        self.world = world
        self.connections: list[Connection] = []
        self.processes = []
        for rank in range(world):
            ours, theirs = context.Pipe()
            process = context.Process(target=_pooled_rank_main, args=(rank, world, theirs))
            process.start()
            theirs.close()
            self.connections.append(ours)
            self.processes.append(process)

    def run(self, scenario: Scenario, directory: Path, deadline: float,
            group_timeout_s: float) -> tuple[int | None, bool]:
        """Run ``scenario`` on every rank; ``(None, False)`` when all returned 0 before ``deadline``
        (a ``time.monotonic()``), else the first failed rank (or None) and whether it was late."""
        for connection in self.connections:
            connection.send((scenario, str(directory), group_timeout_s))
        pending = dict(enumerate(self.connections))
        while pending:
            if time.monotonic() > deadline:
                return None, True
            ready = wait([*pending.values(), *(p.sentinel for p in self.processes)],
                         timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            for rank, connection in list(pending.items()):
                if connection in ready:
                    try:
                        exit_code = connection.recv()
                    except (EOFError, OSError):  # the rank died without answering
                        return rank, False
                    if exit_code != 0:
                        return rank, False
                    del pending[rank]
            dead = [rank for rank, p in enumerate(self.processes) if rank in pending and not p.is_alive()]
            if dead and not any(self.connections[rank].poll() for rank in dead):
                return dead[0], False
        return None, False

    def close(self) -> None:
        """Kill the ranks: between scenarios they hold nothing (group destroyed, results saved), and
        an interpreter's orderly exit after torch costs seconds."""
        for process in self.processes:
            process.kill()
            process.join()
        for connection in self.connections:
            connection.close()


_POOLS: dict[int, _RankPool] = {}


def close_pools(larger_than: int = 0) -> None:
    """End the pools of more than ``larger_than`` spawned ranks."""
    for world in [world for world in _POOLS if world > larger_than]:
        _POOLS.pop(world).close()


atexit.register(close_pools)  # before multiprocessing's own exit handler joins the children


def _run_pooled(scenario: Scenario, world: int, directory: Path, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s  # a pool's start counts, as a spawn's does
    pool = _POOLS.get(world) or _POOLS.setdefault(world, _RankPool(world))
    failed, late = pool.run(scenario, directory, deadline, group_timeout_s=deadline_s / 2)
    if failed is None and not late:
        return
    del _POOLS[world]
    pool.close()
    if late:
        pytest.fail(f"{world} ranks of {scenario.__name__} did not finish in {deadline_s:.0f} s")
    saved = _traceback_file(directory, scenario, failed)
    why = saved.read_text() if saved.exists() else "(no traceback saved)"
    pytest.fail(f"rank {failed} of {world} in {scenario.__name__} failed (pooled rank):\n{why}")


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
    context = _rank_context(backend)
    processes = [
        context.Process(target=_rank_main,
                        args=(rank, world, scenario, str(directory), group_timeout_s, abandon_group, backend))
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
        pytest.fail(f"rank {rank} of {world} in {scenario.__name__} exited with code "
                    f"{processes[rank].exitcode}:\n{why}")
    if alive:
        pytest.fail(f"{world} ranks of {scenario.__name__} did not finish in {deadline_s:.0f} s")
    return [process.exitcode for process in processes]


def load_results(scenario: Scenario, world: int, directory: Path) -> list[dict[str, Any]]:
    """What every rank of ``scenario`` saved, rank by rank."""
    return [torch.load(results_file(directory, scenario, rank), weights_only=False) for rank in range(world)]


def spawn(scenario: Scenario, world: int, directory: Path, *, deadline_s: float,
          backend: str = "gloo") -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world`` ranks of ``backend`` (``run_ranks``, or a pool of gloo ranks
    for a world in ``POOLED_WORLDS``); every rank's results."""
    if backend == "gloo" and world in POOLED_WORLDS:
        _run_pooled(scenario, world, directory, deadline_s)
    else:
        run_ranks(scenario, world, directory, deadline_s=deadline_s, backend=backend)
    return load_results(scenario, world, directory)


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float,
                        atol: float) -> None:
    """The same keys, and every tensor close to the expected one (``rtol=atol=0``: bit-identical)."""
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=rtol, atol=atol, msg=key)
