"""What the drop-in swap costs: ``KFAC(model)`` with nothing else against ``torch.optim.SGD``.

Usage: ``python -m benchmarks.default_cost [--model resnet18|resnet50|gpt] [--size PX] [--batch B]
[--steps 200] [--threads 1] [--conv-positions default,expand,reduce,...] [--out FILE.json]``.

Two copies of the model (same seed) train on the same batches, one with ``torch.optim.SGD(params,
lr)`` and one with ``KFAC(model, lr)`` (the library's defaults: automatic intervals, docs/api.md
"Automatic intervals"). Their steps are **interleaved** (SGD's step i, then K-FAC's step i), so a
load swing on a shared machine hits both alike; each step is ``zero_grad`` + forward + backward +
``step()`` wall-clock. Prints both means over all steps (K-FAC's first decompositions included),
their ratio, the intervals K-FAC chose (counted from shapes, so the same on every run, docs/api.md
"Automatic intervals") and the eigenbasis cap's truncations, and writes them as JSON
(``--out``, default ``runs/default_cost_<model>.json``) with every step's time. Models: ``resnet18`` (32 px,
batch 64, torchvision), ``resnet50`` (224 px, batch 32, torchvision, 1000 classes) and ``gpt`` (the peer
benchmark's character GPT, ``benchmarks/peers/tasks.py``: 2 layers, width 64, context 64, tied head;
batch 32 of random bytes), ``mlp1d`` (the large-batch study's MLP 40-256-256-10,
``benchmarks/large_batch/tasks.py``, on consecutive slices of its training split, batch 128) and every
model of the zoo by its name (``benchmarks/zoo``: its own batches, batch 16, and loss); ``--size`` and
``--batch`` change the images' side and the batch.

``--conv-positions`` runs one ``KFAC(model, lr)`` per entry, each with that
``CurvatureConfig(conv_positions=...)`` ("default": the library's default, ``expand``/``reduce``:
``Expand()``/``Reduce()``, ``sampled``: ``SampledPositions()``, ``reduce_above``: ``ReduceAbove()``),
all interleaved with SGD; the order within a step rotates from step to step. Each K-FAC run's
ratio to SGD's mean is reported (also after the first 3 steps), and the costs its automatic
intervals decided from (``intervals.costs``: the SGD-equivalent step, a factor step's statistics, a
decomposition round, in the intervals' units) with the statistics' ratio to that step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from benchmarks.large_batch.data import splits
from benchmarks.large_batch.tasks import STUDIES
from benchmarks.peers.tasks import CharGPT
from benchmarks.step_time import build_model
from benchmarks.zoo import ZOO
from kfac_optim import KFAC, CurvatureConfig
from kfac_optim.layers import ConvStatistics, Expand, Reduce, ReduceAbove, SampledPositions

IMAGE_MODELS = {"resnet18": (32, 64, 10), "resnet50": (224, 32, 1000)}
"""Per torchvision model: default image side, batch and classes."""
CONV_POSITIONS: dict[str, ConvStatistics | None] = {
    "default": None, "expand": Expand(), "reduce": Reduce(), "sampled": SampledPositions(),
    "reduce_above": ReduceAbove(),
}


def workload(name: str, steps: int, size: int | None = None, batch: int | None = None
             ) -> tuple[Callable[[], nn.Module], list[Any], Callable[[nn.Module, Any], Tensor]]:
    """``(build the model, batches, loss(model, batch))``."""
    generator = torch.Generator().manual_seed(1)
    if name in IMAGE_MODELS:
        default_size, default_batch, classes = IMAGE_MODELS[name]
        size, batch = size or default_size, batch or default_batch
        batches = [(torch.randn(batch, 3, size, size, generator=generator),
                    torch.randint(0, classes, (batch,), generator=generator)) for _ in range(steps)]
        return lambda: build_model(name, size, classes), batches, lambda model, b: F.cross_entropy(model(b[0]), b[1])
    if name == "mlp1d":
        study, (x, y), batch = STUDIES["mlp"], splits().train, batch or 128
        starts = [(i * batch) % (len(x) - batch) for i in range(steps)]
        return study.task.build, [(x[s : s + batch], y[s : s + batch]) for s in starts], lambda model, b: study.loss(
            model, *b)
    if name in ZOO:
        entry = ZOO[name]
        return entry.build, [entry.batch(batch or 16, generator) for _ in range(steps)], entry.loss
    tokens = [torch.randint(0, 256, (batch or 32, 65), generator=generator) for _ in range(steps)]
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]

    def gpt_loss(model: nn.Module, b: tuple[Tensor, Tensor]) -> Tensor:
        out = model(b[0])
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), b[1].reshape(-1))

    return CharGPT, batches, gpt_loss


def _batch_size(batch: Any) -> int:
    """The samples in one of :func:`workload`'s batches (a pair's targets, a zoo batch's first input)."""
    return len(batch[1]) if isinstance(batch, tuple) else len([*batch.args, *batch.kwargs.values()][0])


def _after_calibration(times: list[float]) -> float:
    """The mean step after the automatic intervals' 3 calibration steps (all of them in a shorter run)."""
    return statistics.fmean(times[3:] or times)


class _Collect(logging.Handler):
    """The K-FAC log lines of the run (interval decisions, truncations), kept for the JSON."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=(*IMAGE_MODELS, "gpt", "mlp1d", *ZOO), default="resnet18")
    parser.add_argument("--size", type=int, help="image side in px (default: 32 for resnet18, 224 for resnet50)")
    parser.add_argument("--batch", type=int,
                        help="batch size (default: 64 for resnet18, 128 for mlp1d, 16 for the zoo, 32 otherwise)")
    parser.add_argument("--conv-positions", default="default",
                        help="comma-separated K-FAC runs, each a CurvatureConfig.conv_positions: "
                             f"{', '.join(CONV_POSITIONS)}")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="JSON path (default runs/default_cost_<model>.json)")
    args = parser.parse_args(argv)
    variants = args.conv_positions.split(",")
    unknown = [v for v in variants if v not in CONV_POSITIONS]
    if unknown or len(set(variants)) != len(variants):
        parser.error(f"--conv-positions: unknown or repeated {unknown or variants} "
                     f"(choose from {', '.join(CONV_POSITIONS)})")
    torch.set_num_threads(args.threads)
    build, batches, loss_of = workload(args.model, args.steps, args.size, args.batch)
    collect = _Collect()
    kfac_logger = logging.getLogger("kfac_optim")
    kfac_logger.addHandler(collect)
    previous_level = kfac_logger.level
    kfac_logger.setLevel(logging.INFO)
    kfac_names = ["kfac" if v == "default" and len(variants) == 1 else f"kfac[{v}]" for v in variants]
    names = ["sgd", *kfac_names]
    models, optimizers = {}, {}
    for name in names:
        torch.manual_seed(0)
        models[name] = build().train()
    optimizers["sgd"] = torch.optim.SGD(models["sgd"].parameters(), lr=args.lr)
    for name, variant in zip(kfac_names, variants, strict=True):
        optimizers[name] = KFAC(models[name], lr=args.lr,
                                curvature=CurvatureConfig(conv_positions=CONV_POSITIONS[variant]))
    times: dict[str, list[float]] = {name: [] for name in names}
    load_before = os.getloadavg()[0]
    try:
        for index, batch in enumerate(tqdm(batches, desc=f"{args.model} {'+'.join(names)} steps", file=sys.stderr)):
            for name in names[index % len(names):] + names[: index % len(names)]:  # rotate the order
                start = time.perf_counter()
                optimizers[name].zero_grad(set_to_none=True)
                loss_of(models[name], batch).backward()
                optimizers[name].step()
                times[name].append(time.perf_counter() - start)
    finally:
        kfac_logger.removeHandler(collect)
        kfac_logger.setLevel(previous_level)
    load_after = os.getloadavg()[0]
    sgd = statistics.fmean(times["sgd"])
    result: dict[str, object] = {
        "model": args.model, "size": args.size, "batch": _batch_size(batches[0]), "steps": args.steps,
        "threads": args.threads, "torch": torch.__version__, "load": [load_before, load_after],
        "sgd_mean_s": sgd, "sgd_median_s": statistics.median(times["sgd"]), "log": collect.lines,
        "sgd_step_s": times["sgd"], "kfac": {},
    }
    print(f"{args.model}, batch {result['batch']}, {args.steps} interleaved steps, {args.threads} thread(s), "  # noqa: T201
          f"torch {torch.__version__}, load {load_before:.2f} -> {load_after:.2f}")
    print(f"SGD mean {sgd * 1e3:.1f} ms (median {result['sgd_median_s'] * 1e3:.1f})")  # noqa: T201
    for name, variant in zip(kfac_names, variants, strict=True):
        kfac, intervals = statistics.fmean(times[name]), optimizers[name].estimator.intervals
        costs = intervals.costs
        entry = {
            "conv_positions": variant, "mean_s": kfac, "median_s": statistics.median(times[name]),
            "ratio": kfac / sgd, "intervals": intervals.describe(),
            "ratio_after_calibration": _after_calibration(times[name]) / _after_calibration(times["sgd"]),
            "chosen": list(intervals.chosen or ()),
            "costs": None if costs is None else dataclasses.asdict(costs),
            "statistics_over_step": None if costs is None else costs.factor / costs.step,
            "method": repr(optimizers[name].method), "step_s": times[name],
        }
        result["kfac"][name] = entry
        if len(kfac_names) == 1:  # the single run's figures at the top level too, as before
            result.update({"kfac_mean_s": kfac, "ratio": kfac / sgd, "kfac_median_s": entry["median_s"],
                           "intervals": entry["intervals"], "chosen": entry["chosen"], "method": entry["method"],
                           "kfac_step_s": times[name]})
        print(f"{name}: mean {kfac * 1e3:.1f} ms (median {entry['median_s'] * 1e3:.1f}; first {times[name][0]:.2f} s); "  # noqa: T201
              f"ratio {kfac / sgd:.2f}x ({entry['ratio_after_calibration']:.2f}x after the 3 calibration steps); "
              f"{intervals.describe()}"
              + ("" if costs is None else f"; statistics {costs.factor:.3g} = "
                                          f"{costs.factor / costs.step:.2f}x the step "
                 "(the intervals' units)"))
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
