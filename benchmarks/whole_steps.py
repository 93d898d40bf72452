"""Whole training steps through the public API: first step, mean, median and p95, side by side.

Usage: ``python -m benchmarks.whole_steps [--model resnet18] [--steps 21] [--runs sync async] ...``
(``--help`` lists every flag). Prints a table, writes JSON and a PNG of per-step times (``--out``).

Each run builds the model afresh (same seed, same batches: one fixed random batch per step),
wraps it in the optimizer and times ``zero_grad`` + forward + backward + ``step()`` wall-clock,
step by step. Runs:

  sync     ``KFAC(model, ...)`` with the workload's intervals (decompositions in line)
  async    the same with ``asynchronous=AsyncConfig()`` (decompositions on a worker)
  stagger  ``sync`` with ``CurvatureConfig(stagger=True)`` (each layer folds on its own step of the interval)
  async-stagger  ``async`` with ``CurvatureConfig(stagger=True)``
  statistics ``sync`` with ``async_statistics=True`` (Gram products and folds on a worker thread)
  async-statistics  ``async`` with ``async_statistics=True``: decompositions and statistics off the
           step's critical path
  async-stagger-statistics  ``async-statistics`` with ``CurvatureConfig(stagger=True)``
  defaults ``KFAC(model, lr, momentum, weight_decay)``: the library's default intervals and damping
           (what a user swapping SGD for K-FAC meets first)
  sgd      ``torch.optim.SGD`` (the floor)
  kaisa    KAISA (``kfac-pytorch``'s ``KFACPreconditioner`` + SGD, eigen, the same intervals,
           damping and lr), only when ``kfac`` is importable; not a dependency of this project

After the ``sync`` run, ``--precondition`` times the per-step preconditioning of every block
(``block.precondition``, median of repeats) with decompositions of the run's final factors, twice:
rank-aware ones (as the optimizer computes them) and full ones of the same factors
(``linalg.symmetric_eigen`` without a rank threshold: the Q shapes and solve every layer used
before rank-aware preconditioning).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn
from tqdm import tqdm

from benchmarks.output import write_json_and_plot
from benchmarks.step_time import add_workload_arguments, build_model, workload_shape
from kfac_optim import KFAC, AsyncConfig, CurvatureConfig, RuntimeConfig, linalg
from kfac_optim.methods import method_named

RUNS = ("sync", "async", "stagger", "async-stagger", "statistics", "async-statistics", "async-stagger-statistics",
        "defaults", "sgd", "kaisa")
KFAC_RUNS = {  # run: (AsyncConfig(), CurvatureConfig(stagger=...), RuntimeConfig(async_statistics=...))
    "sync": (False, False, False),
    "async": (True, False, False),
    "stagger": (False, True, False),
    "async-stagger": (True, True, False),
    "statistics": (False, False, True),
    "async-statistics": (True, False, True),
    "async-stagger-statistics": (True, True, True),
}


def kaisa_available() -> bool:
    try:
        import kfac  # noqa: F401
    except ImportError:
        return False
    return True


def make_step(run: str, model: nn.Module, args: argparse.Namespace) -> tuple[Callable[[], None], Any]:
    """The run's ``step()`` after a backward, and the object holding its state."""
    common = dict(lr=args.lr, momentum=0.9, weight_decay=5e-4)
    intervals = dict(factor_update_steps=args.factor_interval, decomposition_update_steps=args.inverse_interval)
    if run == "sgd":
        sgd = torch.optim.SGD(model.parameters(), **common)
        return sgd.step, sgd
    if run == "defaults":
        kfac = KFAC(model, **common)
        return kfac.step, kfac
    if run in KFAC_RUNS:
        decompositions, stagger, statistics = KFAC_RUNS[run]
        kfac = KFAC(model, **common, **intervals, damping=args.damping, curvature=CurvatureConfig(stagger=stagger),
                    asynchronous=AsyncConfig() if decompositions else None,
                    runtime=RuntimeConfig(async_statistics=statistics))
        return kfac.step, kfac
    from kfac.preconditioner import KFACPreconditioner  # kfac-pytorch (KAISA)

    sgd = torch.optim.SGD(model.parameters(), **common)
    preconditioner = KFACPreconditioner(model, **intervals, damping=args.damping, lr=args.lr)

    def step() -> None:
        preconditioner.step()
        sgd.step()

    return step, preconditioner


def time_run(run: str, args: argparse.Namespace,
             batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], Any]:
    torch.manual_seed(0)
    image_size, _ = workload_shape(args)
    model = build_model(args.model, image_size)
    model.train()
    step, state = make_step(run, model, args)
    times = []
    for x, y in tqdm(batches, desc=run, leave=False):
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        step()
        times.append(time.perf_counter() - start)
    return times, state


def summary(times: list[float]) -> dict[str, float]:
    rest = times[1:] or times
    p95 = statistics.quantiles(rest, n=20)[-1] if len(rest) >= 2 else rest[0]
    return {"first_s": times[0], "mean_s": statistics.fmean(times), "median_s": statistics.median(rest),
            "p95_s": p95, "max_s": max(rest), "p95_over_median": p95 / statistics.median(rest)}


def windows(times: list[float], factor_interval: int, size: int) -> list[dict[str, float]]:
    """Per window of ``size`` steps (step 0 left out): the median of the factor steps (every
    ``factor_interval``-th) and of the others, and the window's p95 over its median. A spike is a
    factor step far above the other steps of its window; a drift is windows whose medians differ."""
    rows = []
    for start in range(1, len(times), size):
        steps = range(start, min(start + size, len(times)))
        factor = [times[k] for k in steps if k % factor_interval == 0]
        other = [times[k] for k in steps if k % factor_interval != 0]
        window = [times[k] for k in steps]
        if len(window) < 2 or not factor or not other:
            continue
        median = statistics.median(window)
        rows.append({"first_step": start, "last_step": steps[-1], "median_s": median,
                     "factor_median_s": statistics.median(factor), "other_median_s": statistics.median(other),
                     "p95_over_median": statistics.quantiles(window, n=20)[-1] / median})
    return rows


def precondition_times(optimizer: KFAC, damping: float, repeats: int) -> dict[str, Any]:
    """Per-step preconditioning of every block with decompositions of its current running factors:
    rank-aware (as the optimizer would compute them now) vs full."""
    grads = {b.name: torch.randn(b.G.dim, b.A.dim) for b in optimizer.blocks}
    held = {}
    for b in optimizer.blocks:
        thresholds = b.rank_thresholds(method_named("eigen"), damping)
        held[b.name] = {n: linalg.symmetric_eigen(f.running, torch.float32, thresholds[n], f.rank_bound)
                        for n, f in b.factors.items()}
    full = {b.name: {n: linalg.symmetric_eigen(f.running, torch.float32) for n, f in b.factors.items()}
            for b in optimizer.blocks}

    def run_with(decompositions: dict[str, dict[str, Any]]) -> float:
        for block in optimizer.blocks:
            for name, factor in block.factors.items():
                factor.adopt(decompositions[block.name][name], method_named("eigen").keyed_shift(damping))
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for block in optimizer.blocks:
                block.precondition(grads[block.name], method_named("eigen"), damping)
            samples.append(time.perf_counter() - start)
        return statistics.median(samples[1:])

    full_s, rank_aware_s = run_with(full), run_with(held)  # leaves the rank-aware ones in place
    columns = {f"{b.name}.{n}": [f.dim, int(f.decomposition.Q.shape[1])] for b in optimizer.blocks
               for n, f in b.factors.items()}
    return {"full_s": full_s, "rank_aware_s": rank_aware_s, "dim_and_columns": columns}


def plot(results: dict[str, dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.subplots()
    for run, result in results.items():
        ax.plot(range(len(result["times_s"])), result["times_s"], marker=".", linewidth=1, label=run)
    ax.set(xlabel="step", ylabel="step time (s)", yscale="log", title="whole steps")
    ax.legend()
    return fig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--factor-interval", type=int, default=10)
    parser.add_argument("--inverse-interval", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=["sync", "kaisa"],
                        help="kaisa is skipped when kfac-pytorch is not importable")
    parser.add_argument("--window", type=int, default=100, help="steps per window of the spike/drift report")
    parser.add_argument("--precondition", action="store_true", help="after sync: rank-aware vs full preconditioning")
    parser.add_argument("--repeats", type=int, default=5, help="repeats for --precondition (median)")
    parser.add_argument("--out", type=Path, default=Path("runs/whole_steps"), help="folder for the JSON and the plot")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    image_size, batch = workload_shape(args)
    batches = [(torch.randn(batch, 3, image_size, image_size), torch.randint(0, 10, (batch,)))
               for _ in range(args.steps)]
    runs = [r for r in args.runs if r != "kaisa" or kaisa_available()]
    if len(runs) < len(args.runs):
        print("kaisa skipped: kfac-pytorch is not importable")  # noqa: T201 (a command-line report)
    results: dict[str, dict[str, Any]] = {}
    for run in runs:
        times, state = time_run(run, args, batches)
        results[run] = {"times_s": times, **summary(times),
                        "windows": windows(times, args.factor_interval, args.window)}
        if run == "sync" and args.precondition:
            results[run]["precondition"] = precondition_times(state, args.damping, args.repeats)
    print(f"{args.model}, batch {batch}, {image_size}px, {args.steps} steps, intervals "  # noqa: T201
          f"{args.factor_interval}/{args.inverse_interval}, {args.threads} thread(s), torch {torch.__version__}")
    print("| run | first s | mean s | median s | p95 s | max s | p95/median |")  # noqa: T201
    print("|---|---|---|---|---|---|---|")  # noqa: T201
    for run, r in results.items():
        print(f"| {run} | {r['first_s']:.2f} | {r['mean_s']:.3f} | {r['median_s']:.3f} | {r['p95_s']:.3f} "  # noqa: T201
              f"| {r['max_s']:.2f} | {r['p95_over_median']:.2f} |")
    print(f"per {args.window} steps: factor-step median / other-step median, p95 / median")  # noqa: T201
    for run, r in results.items():
        cells = [f"{w['first_step']}-{w['last_step']}: {w['factor_median_s'] / w['other_median_s']:.2f}, "
                 f"{w['p95_over_median']:.2f}" for w in r["windows"]]
        print(f"  {run}: " + " | ".join(cells))  # noqa: T201
    if "kaisa" in results and "sync" in results:
        print(f"sync/kaisa: mean {results['sync']['mean_s'] / results['kaisa']['mean_s']:.2f}x, "  # noqa: T201
              f"first step {results['sync']['first_s'] / results['kaisa']['first_s']:.2f}x")
    if "precondition" in results.get("sync", {}):
        p = results["sync"]["precondition"]
        print(f"preconditioning per step: full {p['full_s'] * 1e3:.1f} ms, rank-aware {p['rank_aware_s'] * 1e3:.1f} ms "  # noqa: T201
              f"({p['rank_aware_s'] / p['full_s']:.2f}x)")
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": results, "torch": torch.__version__,
               "machine": platform.machine(), "cpus": os.cpu_count(), "load": os.getloadavg()}
    write_json_and_plot(args.out, "whole_steps", payload, plot(results))
    return payload


if __name__ == "__main__":
    main()
