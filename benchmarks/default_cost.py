"""What the drop-in swap costs: ``KFAC(model)`` with nothing else against ``torch.optim.SGD``.

Usage: ``python -m benchmarks.default_cost [--model resnet18|gpt] [--steps 200] [--threads 1] [--out FILE.json]``.

Two copies of the model (same seed) train on the same batches, one with ``torch.optim.SGD(params,
lr)`` and one with ``KFAC(model, lr)`` (the library's defaults: automatic intervals, docs/api.md
"Automatic intervals"). Their steps are **interleaved** (SGD's step i, then K-FAC's step i), so a
load swing on a shared machine hits both alike; each step is ``zero_grad`` + forward + backward +
``step()`` wall-clock. Prints both means over all steps (K-FAC's first decompositions included),
their ratio, the intervals K-FAC chose (counted from shapes, so the same on every run, docs/api.md
"Automatic intervals") and the eigenbasis cap's truncations, and writes them as JSON
(``--out``, default ``runs/default_cost_<model>.json``) with every step's time. Models: ``resnet18`` (32 px,
batch 64, torchvision) and ``gpt`` (the peer benchmark's character GPT, ``benchmarks/peers/tasks.py``:
2 layers, width 64, context 64, tied head; batch 32 of random bytes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from benchmarks.peers.tasks import CharGPT
from benchmarks.step_time import build_model
from kfac_optim import KFAC


def workload(name: str, steps: int) -> tuple[Callable[[], nn.Module], list[tuple[Tensor, Tensor]],
                                              Callable[[Tensor, Tensor], Tensor]]:
    """``(build the model, batches, loss(outputs, targets))``."""
    generator = torch.Generator().manual_seed(1)
    if name == "resnet18":
        batches = [(torch.randn(64, 3, 32, 32, generator=generator), torch.randint(0, 10, (64,), generator=generator))
                   for _ in range(steps)]
        return lambda: build_model("resnet18", 32), batches, F.cross_entropy
    tokens = [torch.randint(0, 256, (32, 65), generator=generator) for _ in range(steps)]
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    return CharGPT, batches, lambda out, y: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class _Collect(logging.Handler):
    """The K-FAC log lines of the run (interval decisions, truncations), kept for the JSON."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("resnet18", "gpt"), default="resnet18")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="JSON path (default runs/default_cost_<model>.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    build, batches, loss_of = workload(args.model, args.steps)
    collect = _Collect()
    kfac_logger = logging.getLogger("kfac_optim")
    kfac_logger.addHandler(collect)
    previous_level = kfac_logger.level
    kfac_logger.setLevel(logging.INFO)
    models, optimizers = {}, {}
    for name in ("sgd", "kfac"):
        torch.manual_seed(0)
        models[name] = build().train()
    optimizers["sgd"] = torch.optim.SGD(models["sgd"].parameters(), lr=args.lr)
    optimizers["kfac"] = KFAC(models["kfac"], lr=args.lr)
    times: dict[str, list[float]] = {"sgd": [], "kfac": []}
    load_before = os.getloadavg()[0]
    try:
        for x, y in tqdm(batches, desc=f"{args.model} SGD+KFAC steps", file=sys.stderr):
            for name in ("sgd", "kfac"):
                start = time.perf_counter()
                optimizers[name].zero_grad(set_to_none=True)
                loss_of(models[name](x), y).backward()
                optimizers[name].step()
                times[name].append(time.perf_counter() - start)
    finally:
        kfac_logger.removeHandler(collect)
        kfac_logger.setLevel(previous_level)
    load_after = os.getloadavg()[0]
    sgd, kfac = statistics.fmean(times["sgd"]), statistics.fmean(times["kfac"])
    intervals = optimizers["kfac"].estimator.intervals
    result: dict[str, object] = {
        "model": args.model, "steps": args.steps, "threads": args.threads, "torch": torch.__version__,
        "load": [load_before, load_after],
        "sgd_mean_s": sgd, "kfac_mean_s": kfac, "ratio": kfac / sgd,
        "sgd_median_s": statistics.median(times["sgd"]), "kfac_median_s": statistics.median(times["kfac"]),
        "intervals": intervals.describe(), "chosen": list(intervals.chosen or ()),
        "method": repr(optimizers["kfac"].method), "log": collect.lines,
        "sgd_step_s": times["sgd"], "kfac_step_s": times["kfac"],
    }
    print(f"{args.model}, {args.steps} interleaved steps, {args.threads} thread(s), torch {torch.__version__}, "  # noqa: T201
          f"load {load_before:.2f} -> {load_after:.2f}")
    print(f"SGD mean {sgd * 1e3:.1f} ms (median {result['sgd_median_s'] * 1e3:.1f}); KFAC(model) mean "  # noqa: T201
          f"{kfac * 1e3:.1f} ms (median {result['kfac_median_s'] * 1e3:.1f}; first {times['kfac'][0]:.2f} s); "
          f"ratio {kfac / sgd:.2f}x")
    print(f"{optimizers['kfac'].method!r}; {intervals.describe()}")  # noqa: T201
    for line in collect.lines:
        if line.startswith("K-FAC"):
            print(f"  {line}")  # noqa: T201
    out = args.out or Path("runs") / f"default_cost_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")  # noqa: T201
    return result


if __name__ == "__main__":
    main()
