"""Step time of K-FAC against SGD and AdamW on the peer benchmark's models, and where K-FAC's goes.

Usage: ``python -m benchmarks.peer_steps [--tasks mlp cnn gpt] [--steps 150] [--json PATH]``.

For each task of ``benchmarks.peers`` (its model, batch and loss, and K-FAC as the benchmark builds
it: ``benchmarks.peers.optimizers.build``, the "eigen_adam" method with intervals 5/50), on one
thread as the benchmark runs:

1. **Whole steps**, interleaved: one step of each optimizer in turn (SGD, AdamW, K-FAC, each on
   its own copy of the model and the same batches) so load changes hit them alike, after
   ``--warmup`` untimed steps. A step is ``zero_grad`` + forward + backward + ``step()``,
   wall-clock. K-FAC's mean over ``--steps`` (a multiple of its decomposition interval) carries
   its folds and decompositions amortized; its median is a step with neither.
2. **Breakdown**: ``--profile-steps`` more K-FAC steps under ``torch.profiler``, summed per range
   of ``KFAC.step`` (docs/design.md §4) and divided by the steps: ``kfac.precondition``,
   ``kfac.fold``, ``kfac.decompose``, ``kfac.sgd`` and the rest of ``kfac.step`` (the forward and
   backward, with the capture hooks' statistics, lie outside). The profiler's per-op overhead
   inflates them; read them as shares of ``kfac.step``.
3. **Preconditioning FLOPs** from the blocks' shapes: ``eigen_adam`` rotates every joint gradient
   ``(out, in)`` into and out of the factors' eigenbases, ``2·(2·out²·in + 2·out·in²)`` per block
   and step (a diagonal factor's side is not rotated).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.peers.optimizers import build
from benchmarks.peers.tasks import TASKS

OPTIMIZERS = ("sgd", "adamw", "kfac")
RANGES = ("kfac.precondition", "kfac.fold", "kfac.decompose", "kfac.sgd", "kfac.step")
LR = 1e-3  # the step time does not depend on it


def stepper(task_name: str, optimizer: str) -> tuple[Callable[[], None], Any]:
    """One training step of ``optimizer`` on a fresh model of the task (seed 0), and the optimizer."""
    task = TASKS[task_name]
    torch.manual_seed(0)
    model = task.build()
    opt = build(optimizer, model, LR, task)
    batches = task.batches(0)

    def step() -> None:
        x, y = next(batches)
        opt.zero_grad()
        task.loss(model, x, y).backward()
        opt.step()

    return step, opt


def preconditioning_gflop(opt: Any) -> float:
    """GFLOP per step of ``eigen_adam``'s four rotations over the optimizer's blocks."""
    flop = 0
    for block in opt.blocks:
        out, inner = block.G.dim * block.G.groups, block.A.dim
        flop += 0 if block.G.diagonal else 4 * out * block.G.dim * inner
        flop += 0 if block.A.diagonal else 4 * out * inner * inner
    return flop / 1e9


def measure(task_name: str, args: argparse.Namespace) -> dict[str, Any]:
    steps = {name: stepper(task_name, name) for name in OPTIMIZERS}
    for _ in range(args.warmup):
        for step, _ in steps.values():
            step()
    samples: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}
    for _ in range(args.steps):
        for name, (step, _) in steps.items():
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)
    result: dict[str, Any] = {
        name: {"mean_ms": 1e3 * statistics.mean(s), "median_ms": 1e3 * statistics.median(s)}
        for name, s in samples.items()
    }
    kfac_step, kfac = steps["kfac"]
    totals = dict.fromkeys(RANGES, 0.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        for _ in range(args.profile_steps):
            kfac_step()
    for event in profile.events():
        if event.name in totals:
            totals[event.name] += event.cpu_time_total / 1e3
    per_step = {name: total / args.profile_steps for name, total in totals.items()}
    parts = ("kfac.precondition", "kfac.fold", "kfac.decompose", "kfac.sgd")
    per_step["kfac.step other"] = per_step["kfac.step"] - sum(per_step[name] for name in parts)
    result["kfac_breakdown_ms"] = per_step
    result["preconditioning_gflop"] = preconditioning_gflop(kfac)
    return result


def report(task_name: str, result: dict[str, Any]) -> str:
    adamw, sgd, kfac = result["adamw"], result["sgd"], result["kfac"]
    lines = [f"{task_name}: " + ", ".join(
        f"{name} {result[name]['mean_ms']:.2f} ms mean / {result[name]['median_ms']:.2f} median" for name in OPTIMIZERS)
        + f"; kfac/adamw {kfac['mean_ms'] / adamw['mean_ms']:.2f}x mean, "
          f"{kfac['median_ms'] / adamw['median_ms']:.2f}x median; kfac/sgd "
          f"{kfac['mean_ms'] / sgd['mean_ms']:.2f}x mean"]
    lines.append("  K-FAC step, ms/step (profiled): " + ", ".join(
        f"{name} {value:.2f}" for name, value in result["kfac_breakdown_ms"].items()))
    lines.append(f"  preconditioning: {result['preconditioning_gflop']:.3f} GFLOP/step")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["mlp", "cnn", "gpt"])
    parser.add_argument("--steps", type=int, default=150, help="timed steps per optimizer (a multiple of 50)")
    parser.add_argument("--warmup", type=int, default=60, help="untimed steps per optimizer first")
    parser.add_argument("--profile-steps", type=int, default=50, help="profiled K-FAC steps for the breakdown")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (the peer benchmark's: 1)")
    parser.add_argument("--json", type=Path, default=Path("runs") / "peer_steps.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import kfac_optim

    results = {}
    for task_name in args.tasks:
        results[task_name] = measure(task_name, args)
        print(report(task_name, results[task_name]), flush=True)
    payload = {"results": results, "args": {k: str(v) for k, v in vars(args).items()}, "torch": torch.__version__,
               "kfac_optim": kfac_optim.__file__, "machine": platform.machine()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1))
    print(f"kfac_optim from {kfac_optim.__file__}; wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
