"""One run to a target, and the protocol: an lr grid per optimizer and batch, then seeds at the chosen lr.

Owns: the run (steps to a target accuracy and the CPU time of the training steps), the lr grid at each
batch, the selection on validation, the seeds, the summary per batch and the critical batch.
Must not know: how optimizers are built (``benchmarks.peers.optimizers``), the projection to GPUs.

A run: one thread, seed, model, optimizer (``benchmarks.peers.optimizers.build``: the peers' builders and
lr grids), one untimed forward/backward, then steps over shuffled epochs of the training split until
both validation and test accuracy reached the task's target, the loss is not finite (diverged) or
``max_steps``. A K-FAC with ``fisher="sampled"`` gets ``sample_fisher(logits, "cross_entropy")``
before the backward. CPU time is ``time.process_time`` around zero_grad, forward, backward and step only.
Accuracy is evaluated (untimed) at every step up to 10, every 5 up to 100, then every 10.

The protocol, per task and batch: each optimizer's lr grid, ``points`` rates spaced by sqrt(10) around
its family's centre (``optimizers.lr_grid``), on seed 0, extended by one rate beyond an edge (up to
:data:`MAX_EXTENSIONS` times) while the chosen rate sits at that edge: the same search for every
optimizer, at every batch; a 1-point grid is not extended. The lr with the fewest steps to the
target on **validation** wins (ties and no-reach: the higher final validation accuracy); then
seeds 1..n-1 at that lr, and the seed-0 run joins them. Steps and CPU time to the target are read on
**test** (interpolated between evaluations, ``benchmarks.peers.analysis.time_to``).

**Critical batch** (an optimizer's, on a task): between neighbouring batches ``B₁ < B₂`` of the sweep
the per-doubling gain is ``(steps(B₁)/steps(B₂)) ** (1/log2(B₂/B₁))``; the critical batch is the
largest batch reached while every gain so far is at least 1.5 (doubling the batch still cuts the
steps by 1.5x or more), the smallest batch if the first gain is below it, and "> largest" is not
claimed: the largest batch of the sweep is the most the sweep can show.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

import kfac_optim
from benchmarks.large_batch.data import splits
from benchmarks.large_batch.tasks import STUDIES, Study
from benchmarks.peers import optimizers
from benchmarks.peers.analysis import time_to

Run = dict[str, Any]
CRITICAL_GAIN = 1.5
"""Per-doubling cut in steps that counts as still gaining from the batch."""


@dataclass(frozen=True)
class RunSpec:
    task: str
    optimizer: str
    batch: int
    lr: float
    seed: int
    max_steps: int


def _evaluated(step: int) -> bool:
    return step <= 10 or (step <= 100 and step % 5 == 0) or step % 10 == 0


def _batches(x: torch.Tensor, y: torch.Tensor, batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x) - batch + 1, batch):
            index = order[start:start + batch]
            yield x[index], y[index]


def train(spec: RunSpec) -> Run:
    """One run (module docstring): the spec, its evaluations, steps, CPU seconds per step, warnings."""
    torch.set_num_threads(1)
    study = STUDIES[spec.task]
    torch.manual_seed(spec.seed)
    model = study.task.build()
    batches = _batches(*splits().train, spec.batch, spec.seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = optimizers.build(spec.optimizer, model, spec.lr, study.task)
        study.loss(model, *next(batches)).backward()  # untimed warm-up
        optimizer.zero_grad(set_to_none=True)
        history = [{"step": 0, "time_s": 0.0, "val": study.accuracy(model, "val"),
                    "test": study.accuracy(model, "test")}]
        spent, step, diverged = 0.0, 0, False
        closure_step = optimizers.needs_closure(spec.optimizer)
        sampled = isinstance(optimizer, kfac_optim.KFAC) and optimizer.options.curvature.fisher == "sampled"
        while step < spec.max_steps:
            x, y = next(batches)
            start = time.process_time()
            if closure_step:
                loss = optimizer.step(_closure(study, model, optimizer, x, y))
            else:
                optimizer.zero_grad(set_to_none=True)
                out = model(x)
                if sampled:  # the sampled Fisher's backward, before the loss's (docs/api.md)
                    optimizer.sample_fisher(out, "cross_entropy")
                loss = nn.functional.cross_entropy(out, y)
                loss.backward()
                optimizer.step()
            spent += time.process_time() - start
            step += 1
            if not math.isfinite(loss.item()):
                diverged = True
                break
            if _evaluated(step) or step == spec.max_steps:
                row = {"step": step, "time_s": spent, "val": study.accuracy(model, "val"),
                       "test": study.accuracy(model, "test")}
                history.append(row)
                if row["val"] >= study.target and row["test"] >= study.target:
                    break
    return {**asdict(spec), "history": history, "diverged": diverged, "steps": step, "step_s": spent / max(step, 1),
            "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught})}


def _closure(study: Study, model: torch.nn.Module, optimizer: Any, x: torch.Tensor,
             y: torch.Tensor) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = study.loss(model, x, y)
        if torch.is_grad_enabled():
            loss.backward()
        return loss
    return closure


def to_target(run: Run, split: str, clock: str = "step") -> float:
    """Steps (``clock="time_s"``: CPU seconds) at which ``split`` accuracy reached the target; inf if never."""
    return time_to(run["history"], STUDIES[run["task"]].target, True, split, clock)


def selection_key(run: Run) -> tuple[float, float]:
    """Smaller is better: steps to the target on validation, then minus the final validation accuracy."""
    final_val = -math.inf if run["diverged"] else run["history"][-1]["val"]
    return to_target(run, "val"), -final_val


MAX_EXTENSIONS = optimizers.MAX_EXTENSIONS


def search(run_all: Callable[[list[RunSpec]], list[Run]], task: str, names: list[str], batches: list[int],
           points: int, max_steps: int) -> tuple[list[Run], dict[tuple[str, int], Run]]:
    """The grid search of every optimizer at every batch (module docstring): ``run_all`` runs a list of
    seed-0 specs (a round at a time, so that parallel workers stay busy); every grid run, and the
    chosen lr's run per (optimizer, batch)."""
    grids = {(n, b): optimizers.grid_points(points) for b in batches for n in names}
    runs: dict[tuple[str, int, int], Run] = {}
    for extension in range(MAX_EXTENSIONS + 1):
        todo = [(n, b, k) for (n, b), ks in grids.items() for k in ks if (n, b, k) not in runs]
        specs = [RunSpec(task, n, b, optimizers.rate(n, k), 0, max_steps) for n, b, k in todo]
        runs.update(zip(todo, run_all(specs), strict=True))
        if extension == MAX_EXTENSIONS:
            break
        grown = [optimizers.extend_at_edge(ks, min(ks, key=lambda k: selection_key(runs[(n, b, k)])))
                 for (n, b), ks in grids.items()]
        if not any(grown):
            break
    chosen = {(n, b): min((runs[(n, b, k)] for k in ks), key=selection_key) for (n, b), ks in grids.items()}
    return list(runs.values()), chosen


def seed_specs(chosen: dict[tuple[str, int], Run], seeds: int) -> list[RunSpec]:
    return [RunSpec(r["task"], r["optimizer"], r["batch"], r["lr"], seed, r["max_steps"])
            for r in chosen.values() for seed in range(1, seeds)]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def summarize(chosen: dict[tuple[str, int], Run], seed_runs: list[Run]) -> list[dict[str, Any]]:
    """Per (optimizer, batch): the chosen lr, per-seed and median steps and CPU seconds to the target on
    test (inf: never), and the median CPU ms per step."""
    rows = []
    for (name, batch), first in sorted(chosen.items(), key=lambda item: (item[0][1], item[0][0])):
        runs = [first] + [r for r in seed_runs if (r["optimizer"], r["batch"]) == (name, batch)]
        steps = [to_target(r, "test") for r in runs]
        seconds = [to_target(r, "test", "time_s") for r in runs]
        rows.append({"optimizer": name, "batch": batch, "lr": first["lr"], "steps": steps, "seconds": seconds,
                     "median_steps": _median(steps), "median_s": _median(seconds),
                     "step_ms": 1e3 * _median([r["step_s"] for r in runs]),
                     "diverged": sum(r["diverged"] for r in runs)})
    return rows


def critical_batch(steps_by_batch: dict[int, float]) -> int | None:
    """The critical batch of one optimizer (module docstring); None if it never reached the target."""
    batches = sorted(b for b, s in steps_by_batch.items() if math.isfinite(s))
    if not batches:
        return None
    critical = batches[0]
    for small, large in zip(batches, batches[1:]):
        gain = (steps_by_batch[small] / steps_by_batch[large]) ** (1 / math.log2(large / small))
        if gain < CRITICAL_GAIN:
            break
        critical = large
    return critical
