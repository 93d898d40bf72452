"""One training run on a CPU-time budget, and the tuning protocol that schedules the runs.

A run: ``torch.set_num_threads(1)``, seed, model, optimizer, one untimed forward/backward (torch's
one-time costs; gradients dropped), then steps until the training CPU time
(``time.process_time`` around zero_grad, forward, backward and step only) reaches the task's
budget. The metric is evaluated on validation and test at time 0 and each time training time
crosses another ``1/evals`` of the budget (evaluation is not timed). A non-finite training loss
ends the run as diverged.

The protocol, one task at a time: phase 1 runs each optimizer's lr grid on seed 0 and scores each lr by its final
validation metric, adding the next rate beyond an edge while the best sits there (at most
``optimizers.MAX_EXTENSIONS`` rounds, `optimizers.extend_at_edge`); phase 2 runs the best lr on seeds
1..n-1, and the seed-0 run of the best lr serves as the first seed (its test metric was never used
for the choice).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from typing import Any

import torch

from benchmarks.peers import optimizers
from benchmarks.peers.tasks import TASKS

Run = dict[str, Any]


@dataclass(frozen=True)
class RunSpec:
    task: str
    optimizer: str
    lr: float
    seed: int
    budget_s: float
    evals: int


def train(spec: RunSpec) -> Run:
    """Train one run (see the module docstring); returns the spec, the eval history and any warnings."""
    torch.set_num_threads(1)
    task = TASKS[spec.task]
    torch.manual_seed(spec.seed)
    model = task.build()
    batches = task.batches(spec.seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = optimizers.build(spec.optimizer, model, spec.lr, task)
        task.loss(model, *next(batches)).backward()  # untimed warm-up
        optimizer.zero_grad(set_to_none=True)

        def record(step: int, seconds: float, loss: float) -> dict[str, float]:
            return {"step": step, "time_s": seconds, "train_loss": loss,
                    "val": task.evaluate(model, "val"), "test": task.evaluate(model, "test")}

        history = [record(0, 0.0, math.nan)]
        spent, step, diverged = 0.0, 0, False
        every = spec.budget_s / spec.evals
        next_eval = every
        closure_step = optimizers.needs_closure(spec.optimizer)
        while spent < spec.budget_s:
            x, y = next(batches)
            start = time.process_time()
            if closure_step:
                loss = optimizer.step(_closure(task, model, optimizer, x, y))
            else:
                optimizer.zero_grad(set_to_none=True)
                loss = task.loss(model, x, y)
                loss.backward()
                optimizer.step()
            spent += time.process_time() - start
            step += 1
            value = loss.item()
            diverged = not math.isfinite(value)
            if diverged or spent >= next_eval or spent >= spec.budget_s:
                history.append(record(step, spent, value))
                next_eval += every
            if diverged:
                break
    messages = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return {**asdict(spec), "history": history, "diverged": diverged, "steps": step,
            "step_s": spent / max(step, 1), "warnings": messages}


def _closure(task: Any, model: torch.nn.Module, optimizer: Any, x: torch.Tensor,
             y: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The step's zero_grad, forward and backward as a closure; backward only with grad enabled
    (``AdaptiveDamping`` calls it once more under ``torch.no_grad()``)."""
    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(model, x, y)
        if torch.is_grad_enabled():
            loss.backward()
        return loss
    return closure


def final(run: Run, split: str) -> float:
    """The run's last evaluated ``split`` metric (NaN after a divergence)."""
    return math.nan if run["diverged"] else run["history"][-1][split]


def score(run: Run, higher_is_better: bool) -> float:
    """Larger is better; a diverged or NaN run scores -inf."""
    value = final(run, "val")
    if math.isnan(value):
        return -math.inf
    return value if higher_is_better else -value


class Runner:
    """Runs specs inline (``jobs`` 1) or in ``jobs`` spawned worker processes, reporting each finished
    run. ``run``: what runs one spec (a module-level function, so that workers can import it): this
    module's :func:`train` by default; ``benchmarks.large_batch`` passes its own."""

    def __init__(self, jobs: int, on_done: Callable[[Any], None], run: Callable[[Any], Any] | None = None) -> None:
        self.jobs, self.on_done, self.run = jobs, on_done, train if run is None else run
        self.pool = ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) if jobs > 1 else None

    def map(self, specs: Iterable[Any]) -> list[Any]:
        if self.pool is None:
            runs = []
            for spec in specs:
                runs.append(self.run(spec))
                self.on_done(runs[-1])
            return runs
        futures: list[Future[Any]] = [self.pool.submit(self.run, spec) for spec in specs]
        for future in futures:
            future.add_done_callback(lambda f: self.on_done(f.result()))
        return [future.result() for future in futures]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def search(runner: Runner, task: str, names: list[str], points: int, budget: float,
           evals: int) -> dict[str, list[Run]]:
    """Phase 1: ``{optimizer: its seed-0 grid runs, lr ascending}``, each grid grown at an edge while its best
    sits there (a round of every optimizer's new rates at a time, so that parallel workers stay busy)."""
    higher_is_better = TASKS[task].higher_is_better
    grids = {n: optimizers.grid_points(points) for n in names}
    runs: dict[tuple[str, int], Run] = {}
    for extension in range(optimizers.MAX_EXTENSIONS + 1):
        todo = [(n, k) for n, ks in grids.items() for k in ks if (n, k) not in runs]
        specs = [RunSpec(task, n, optimizers.rate(n, k), 0, budget, evals) for n, k in todo]
        runs.update(zip(todo, runner.map(specs), strict=True))
        if extension == optimizers.MAX_EXTENSIONS:
            break
        grown = [optimizers.extend_at_edge(ks, max(ks, key=lambda k: score(runs[(n, k)], higher_is_better)))
                 for n, ks in grids.items()]
        if not any(grown):
            break
    return {n: [runs[(n, k)] for k in ks] for n, ks in grids.items()}


def tune_and_seed(runner: Runner, task: str, names: list[str], points: int, seeds: int, budget_scale: float,
                  evals: int) -> dict[str, Any]:
    """Both phases for every optimizer on one task: ``{optimizer: {"grid": runs, "best_lr", "seeds": runs}}``."""
    budget = TASKS[task].budget_s * budget_scale
    results: dict[str, Any] = {}
    for n, runs in search(runner, task, names, points, budget, evals).items():
        best = max(runs, key=lambda r: score(r, TASKS[task].higher_is_better))
        results[n] = {"grid": runs, "best_lr": best["lr"], "seeds": [best]}
    for run in runner.map([RunSpec(task, n, results[n]["best_lr"], seed, budget, evals)
                           for n in names for seed in range(1, seeds)]):
        results[run["optimizer"]]["seeds"].append(run)
    return results
