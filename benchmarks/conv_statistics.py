"""What a convolution's statistics cost and what they buy: ``CurvatureConfig.conv_positions`` compared.

Usage: ``python -m benchmarks.conv_statistics [--part cost|progress|both] [--model resnet50] [--size 224]
[--batch 32] [--repeats 3] [--steps 200] [--seeds 0,1,2] [--threads 1] [--out benchmarks/results/conv_statistics]``.

- ``cost``: a torchvision model (ResNet-50 at 224 px, batch 32 by default) on one random batch. Its
  blocks' (input, output-gradient) pairs are captured once; then, ``--repeats`` times, SGD's step
  (zero_grad, forward, backward, ``step()``) and each kind's factor-step statistics (every block's
  ``accumulate`` of its pair and its ``fold``: what a factor step adds but the hooks) are timed
  one after another, the order rotating each repeat, so a load swing on a shared machine hits all
  alike. Reported: medians, each kind's statistics over SGD's step, and per layer (last repeat).
- ``progress``: loss per step of ``KFAC(model, lr, momentum=0.9)`` with each kind, on the peers
  benchmark's digits CNN (8 px, ``benchmarks/peers/tasks.py``) and the same digits upsampled to
  32 px by the model's first layer (conv 16, conv 32 stride 2, conv 32 stride 2: 1024, 256 and 64
  positions), fixed intervals 1/10 (the automatic ones read the clock), ``--seeds`` seeds
  (the batch order and the initialization), ``--steps`` steps; the train loss averaged over the
  last 20 steps and the validation accuracy at the end.

Kinds: ``expand`` (every position a row, today's), ``reduce`` (mean patch, summed output-gradient,
Eschenhagen et al. 2023), ``sampled`` (``SampledPositions(64)``), ``reduce_above``
(``ReduceAbove()``, the rule). JSON + PNG under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn
from tqdm import tqdm

from benchmarks.output import write_json_and_plot
from benchmarks.peers.tasks import TASKS, Task
from benchmarks.step_time import build_model, capture_batch
from kfac_optim import KFAC, CurvatureConfig
from kfac_optim.layers import ConvStatistics, Expand, Reduce, ReduceAbove, SampledPositions, discover_blocks

KINDS: dict[str, ConvStatistics] = {
    "expand": Expand(), "reduce": Reduce(), "sampled": SampledPositions(64), "reduce_above": ReduceAbove(),
}


class Digits32CNN(nn.Sequential):
    """8x8 digits upsampled to 32x32 (bilinear), conv3x3 1->16, conv3x3 16->32 /2, conv3x3 32->32 /2
    (ReLU after each), flatten (32*8*8), Linear -> 10: convs with 1024, 256 and 64 output positions."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(
            nn.Upsample(scale_factor=4, mode="bilinear", align_corners=False),
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(32 * 8 * 8, num_classes),
        )


PROGRESS_TASKS: dict[str, Task] = {
    "cnn": TASKS["cnn"],
    "cnn32": dataclasses.replace(TASKS["cnn"], name="cnn32", build=Digits32CNN, heads=("8",),
                                 description="digits upsampled to 32 px, conv16-conv32/2-conv32/2-10, batch 128"),
}


def measure_cost(args: argparse.Namespace, kinds: list[str]) -> dict[str, object]:
    classes = 1000 if args.model == "resnet50" else 10
    torch.manual_seed(0)
    model = build_model(args.model, args.size, classes).train()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=generator)
    y = torch.randint(0, classes, (args.batch,), generator=generator)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    blocks = {kind: discover_blocks(model, conv_positions=KINDS[kind]) for kind in kinds}

    def forward_backward() -> None:
        F.cross_entropy(model(x), y).backward()

    pairs = capture_batch(blocks[kinds[0]], forward_backward)
    names = ["sgd", *kinds]
    times: dict[str, list[float]] = {name: [] for name in names}
    per_layer: dict[str, dict[str, float]] = {kind: {} for kind in kinds}
    load = [os.getloadavg()[0]]
    for repeat in tqdm(range(args.repeats), desc=f"{args.model} {args.size}px batch {args.batch}", file=sys.stderr):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            start = time.perf_counter()
            if name == "sgd":
                sgd.zero_grad(set_to_none=True)
                forward_backward()
                sgd.step()
            else:
                for block in blocks[name]:
                    begin = time.perf_counter()
                    block.accumulate(*pairs[block.name])
                    block.fold(0.95, "mean")
                    per_layer[name][block.name] = time.perf_counter() - begin
            times[name].append(time.perf_counter() - start)
    load.append(os.getloadavg()[0])
    step = statistics.median(times["sgd"])
    result = {
        "model": args.model, "size": args.size, "batch": args.batch, "repeats": args.repeats, "threads": args.threads,
        "torch": torch.__version__, "load": load, "sgd_step_s": times["sgd"], "sgd_median_s": step,
        "kinds": {kind: {"conv_positions": repr(KINDS[kind]), "statistics_s": times[kind],
                         "median_s": statistics.median(times[kind]),
                         "over_sgd_step": statistics.median(times[kind]) / step,
                         "per_layer_s": per_layer[kind]} for kind in kinds},
    }
    print(f"{args.model} {args.size}px batch {args.batch}, {args.threads} thread(s), "  # noqa: T201
          f"load {load[0]:.2f} -> {load[1]:.2f}: "
          f"SGD step {step:.2f} s; " + "; ".join(
              f"{kind} statistics {entry['median_s']:.2f} s = {entry['over_sgd_step']:.2f}x"
              for kind, entry in result["kinds"].items()))
    return result


def run_progress(task: Task, kind: str, seed: int, steps: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = task.build()
    optimizer = KFAC(model, lr=0.05, momentum=0.9, factor_update_steps=1, decomposition_update_steps=10,
                     curvature=CurvatureConfig(conv_positions=KINDS[kind]))
    losses = []
    batches = task.batches(seed)
    start = time.process_time()
    for _ in range(steps):
        x, y = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(model, x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    cpu = time.process_time() - start
    optimizer.remove_hooks()
    return {"losses": losses, "final_loss": statistics.fmean(losses[-20:]), "val": task.evaluate(model, "val"),
            "cpu_s": cpu}


def measure_progress(args: argparse.Namespace, kinds: list[str]) -> dict[str, object]:
    seeds = [int(s) for s in args.seeds.split(",")]
    result: dict[str, object] = {"steps": args.steps, "seeds": seeds, "lr": 0.05, "momentum": 0.9,
                                 "intervals": [1, 10], "load": [os.getloadavg()[0]], "tasks": {}}
    jobs = [(task, seed, kind) for task in PROGRESS_TASKS for seed in seeds for kind in kinds]  # kinds alternate
    runs: dict[str, dict[str, list[dict[str, object]]]] = {t: {k: [] for k in kinds} for t in PROGRESS_TASKS}
    for task, seed, kind in tqdm(jobs, desc="progress runs", file=sys.stderr):
        runs[task][kind].append(run_progress(PROGRESS_TASKS[task], kind, seed, args.steps))
    result["load"].append(os.getloadavg()[0])
    for task, by_kind in runs.items():
        summary = {}
        for kind, seeds_runs in by_kind.items():
            finals = [r["final_loss"] for r in seeds_runs]
            summary[kind] = {
                "final_loss": finals, "final_loss_mean": statistics.fmean(finals),
                "final_loss_spread": max(finals) - min(finals), "val": [r["val"] for r in seeds_runs],
                "cpu_s": [r["cpu_s"] for r in seeds_runs], "losses": [r["losses"] for r in seeds_runs],
            }
            print(f"{task} {kind}: loss over the last 20 of {args.steps} steps "  # noqa: T201
                  f"{summary[kind]['final_loss_mean']:.4f} (seeds {', '.join(f'{f:.4f}' for f in finals)}); "
                  f"val accuracy {statistics.fmean(summary[kind]['val']):.4f}; "
                  f"CPU {statistics.fmean(summary[kind]['cpu_s']):.1f} s")
        result["tasks"][task] = {"description": PROGRESS_TASKS[task].description, "kinds": summary}
    return result


def plot(cost: dict[str, object] | None, progress: dict[str, object] | None) -> Figure:
    panels = (cost is not None) + (len(progress["tasks"]) if progress else 0)
    figure = Figure(figsize=(5 * panels, 4), layout="constrained")
    axes = list(figure.subplots(1, panels, squeeze=False)[0])
    if cost is not None:
        axis = axes.pop(0)
        kinds = list(cost["kinds"])
        axis.bar(["SGD step", *kinds], [cost["sgd_median_s"], *(cost["kinds"][k]["median_s"] for k in kinds)])
        axis.axhline(0.5 * cost["sgd_median_s"], color="gray", linestyle="--", label="0.5x SGD's step (goal)")
        axis.set_ylabel("seconds (median)")
        axis.set_title(f"{cost['model']} {cost['size']}px batch {cost['batch']}: factor-step statistics")
        axis.legend()
    for (task, entry), axis in zip((progress or {"tasks": {}})["tasks"].items(), axes, strict=True):
        for kind, summary in entry["kinds"].items():
            curves = torch.tensor(summary["losses"])
            smooth = F.avg_pool1d(curves.unsqueeze(1), min(10, curves.shape[1]), 1).squeeze(1)
            axis.plot(smooth.mean(0), label=f"{kind} ({summary['final_loss_mean']:.3f})")
        axis.set_yscale("log")
        axis.set_xlabel("step")
        axis.set_ylabel("train loss (10-step mean, mean of seeds)")
        axis.set_title(task)
        axis.legend()
    return figure


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("cost", "progress", "both"), default="both")
    parser.add_argument("--model", choices=("resnet18", "resnet50"), default="resnet50")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/conv_statistics"))
    parser.add_argument("--name", default=None, help="file name (default: the part)")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if any(kind not in KINDS for kind in kinds):
        parser.error(f"--kinds: choose from {', '.join(KINDS)}")
    torch.set_num_threads(args.threads)
    cost = measure_cost(args, kinds) if args.part in ("cost", "both") else None
    progress = measure_progress(args, kinds) if args.part in ("progress", "both") else None
    payload = {"cost": cost, "progress": progress}
    write_json_and_plot(args.out, args.name or args.part, payload, plot(cost, progress))
    return payload


if __name__ == "__main__":
    main()
