"""Where the constants of ``kfac_optim.schedule.costs`` come from: each kind of work's rate on this machine,
in flop-equivalents (the time of one floating-point operation of a large matrix product).

Usage: ``python -m benchmarks.cost_constants [--sizes 256 512 1024 2048] [--threads 1] [--repeats 3] [--out DIR]``.

Times, per size ``n`` (best of ``--repeats``): a matrix product ``(n, n) @ (n, n)`` (the rate, in
flop per second, that defines the unit: ``2·n³`` flop), then ``eigh`` (per ``n³``), a damped
Cholesky inverse (per ``n³``), the eigenbasis cap's decomposition at its default ``max_rank``
(``linalg.symmetric_eigen`` as ``Eigen`` calls it: the randomized range eigensolver; per ``n²·c``,
``c = max_rank + oversampling``; sizes above the cap only) and one elementwise scale-and-add pass
over an ``(n, n)`` float32 matrix (per element), each converted
to flop-equivalents at the largest size's matrix-product rate. Prints them next to the constants
the library uses (``costs.EIGH``, ``costs.INVERSE``, ``costs.RANGE``, ``costs.ELEMENT``) and writes
``DIR/cost_constants.json`` and ``.png`` (default ``runs/``). The step-level constants
(``STEP_EFFICIENCY``, the operation counts) come from ``benchmarks.default_cost``'s models
(benchmarks/RESULTS.md "The drop-in's cost: the eigenbasis cap and the budgeted intervals").
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from matplotlib.figure import Figure
from tqdm import tqdm

from benchmarks.output import write_json_and_plot
from kfac_optim import linalg
from kfac_optim.methods import DEFAULT_MAX_RANK
from kfac_optim.schedule import costs

LIBRARY = {"eigh": costs.EIGH, "inverse": costs.INVERSE, "range": costs.RANGE, "element": costs.ELEMENT}
"""The constants of ``kfac_optim.schedule.costs`` each measurement is compared with."""


def best_seconds(work: Callable[[], object], repeats: int, device: torch.device | None = None) -> float:
    """The fastest of ``repeats`` timed calls of ``work`` (after one warm-up call); on a CUDA
    ``device`` each call is timed from a synchronized device until its kernels have finished."""
    def synchronize() -> None:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    work()
    best = float("inf")
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        work()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def measure(sizes: list[int], repeats: int, max_rank: int = DEFAULT_MAX_RANK,
            device: torch.device | None = None) -> dict[str, object]:
    """Seconds per size of each kind of work on ``device`` (default the CPU), the matrix-product rate,
    and each kind's constant in flop-equivalents at the largest size's rate
    (``{"rate": ..., "seconds": ..., "constants": ...}``)."""
    device = device or torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    seconds: dict[str, dict[int, float]] = {name: {} for name in ("product", *LIBRARY)}
    columns = max_rank + linalg.LOW_RANK_OVERSAMPLE
    for n in tqdm(sizes, desc="sizes", file=sys.stderr):
        rows = torch.randn(2 * n, n, generator=generator).to(device)
        factor = rows.T @ rows / (2 * n)
        other = torch.randn(n, n, generator=generator).to(device)
        seconds["product"][n] = best_seconds(lambda: factor @ other, repeats, device)
        seconds["eigh"][n] = best_seconds(lambda: torch.linalg.eigh(factor), repeats, device)
        seconds["inverse"][n] = best_seconds(lambda: linalg.damped_inverse(factor, 0.1, torch.float32), repeats, device)
        if n > max_rank:
            seconds["range"][n] = best_seconds(  # Eigen's capped path: the top max_rank eigenpairs and σ
                lambda: linalg.symmetric_eigen(factor, torch.float32, drop_below=0.0, max_rank=max_rank), repeats,
                device)
        seconds["element"][n] = best_seconds(lambda: other.mul_(0.95).add_(factor, alpha=0.05), repeats, device) / 2
    largest = max(sizes)
    rate = 2.0 * largest**3 / seconds["product"][largest]
    per_unit = {"eigh": lambda n: n**3, "inverse": lambda n: n**3, "range": lambda n: n * n * columns,
                "element": lambda n: n * n}
    constants = {name: {n: t * rate / per_unit[name](n) for n, t in seconds[name].items()} for name in LIBRARY}
    return {"rate_flop_per_s": rate, "seconds": seconds, "constants": constants, "library": LIBRARY,
            "range_columns": columns}


def plot(result: dict[str, object]) -> Figure:
    figure = Figure(figsize=(7, 4))
    axes = figure.add_subplot()
    for index, (name, by_size) in enumerate(result["constants"].items()):
        if not by_size:
            continue
        color = f"C{index}"
        axes.plot(list(by_size), list(by_size.values()), "o-", color=color, label=f"{name} (measured)")
        axes.axhline(result["library"][name], color=color, linestyle="--", linewidth=1)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("factor size n")
    axes.set_ylabel("flop-equivalents per unit of work")
    axes.set_title("kfac_optim.schedule.costs constants (dashed) against this machine")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(sorted(args.sizes), args.repeats)
    result.update(threads=args.threads, torch=torch.__version__)
    print(f"matrix products: {result['rate_flop_per_s'] / 1e9:.1f} GFLOP/s ({args.threads} thread(s))")  # noqa: T201
    for name, by_size in result["constants"].items():
        measured = ", ".join(f"n={n}: {value:.1f}" for n, value in by_size.items())
        print(f"{name}: library {LIBRARY[name]:g}; measured {measured}")  # noqa: T201
    write_json_and_plot(args.out, "cost_constants", result, plot(result))
    return result


if __name__ == "__main__":
    main()
