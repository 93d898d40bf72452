"""K-FAC in fp16 (autocast + ``torch.amp.GradScaler``) against fp32: skipped steps and loss after N steps.

    python -m benchmarks.amp_steps [--steps 200] [--batch 64] [--init-scale 65536] [--device cpu] [--out DIR]

Trains the digits CNN (``benchmarks.models.DigitsCNN`` on the main job's digits split, pixels in
[0, 1]) from the same initial weights on the same batches, once in fp32 and once in fp16 with a
GradScaler. Prints one JSON line per run: steps taken and skipped (GradScaler overflows, and at
which iterations), the loss scale at the end, the mean training loss of the last 10 steps, and
the test loss and accuracy. Writes ``DIR/amp_steps.json`` (the summaries plus every iteration's
loss and scale) and ``DIR/amp_steps.png`` (training loss of both runs with the skipped steps
marked, and the fp16 run's loss scale, against the iteration).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from tqdm import tqdm

from benchmarks.output import write_json_and_plot
from examples.training.config import DataConfig
from examples.training.data import load_datasets
from examples.training.models import DigitsCNN
from kfac_optim import KFAC

KFAC_OPTIONS = dict(lr=0.1, momentum=0.9, weight_decay=5e-4, damping=0.03, kl_clip=1e-3,
                    factor_update_steps=5, decomposition_update_steps=50, method="inverse")


def train(fp16: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``args.steps`` steps; returns its summary and per-iteration history."""
    device = torch.device(args.device)
    data = load_datasets(DataConfig(name="digits", normalize=False))
    x_train, y_train = (t.to(device) for t in data.train.tensors)
    x_test, y_test = (t.to(device) for t in data.test.tensors)
    torch.manual_seed(0)
    model = DigitsCNN().to(device)
    optimizer = KFAC(model, **KFAC_OPTIONS)
    scaler = torch.amp.GradScaler(device.type, init_scale=args.init_scale, enabled=fp16)
    generator = torch.Generator().manual_seed(1)
    name = "fp16+GradScaler" if fp16 else "fp32"
    losses: list[float] = []
    scales: list[float] = []
    skipped_at: list[int] = []
    start = time.perf_counter()
    for iteration in tqdm(range(args.steps), desc=name, leave=False, file=sys.stderr):
        index = torch.randint(0, len(x_train), (args.batch,), generator=generator).to(device)
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
            loss = F.cross_entropy(model(x_train[index]), y_train[index])
        scaler.scale(loss).backward()
        taken = optimizer.steps
        scales.append(scaler.get_scale() if fp16 else 1.0)
        scaler.step(optimizer)
        scaler.update()
        if optimizer.steps == taken:
            skipped_at.append(iteration)
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.float16, enabled=fp16):
        logits = model(x_test).float()
    summary = {
        "run": name,
        "steps": args.steps,
        "optimizer_steps": optimizer.steps,
        "skipped": len(skipped_at),
        "skipped_at": skipped_at,
        "final_scale": scaler.get_scale() if fp16 else None,
        "train_loss_last10": round(sum(losses[-10:]) / len(losses[-10:]), 4),
        "test_loss": round(F.cross_entropy(logits, y_test).item(), 4),
        "test_acc": round((logits.argmax(1) == y_test).float().mean().item(), 4),
        "seconds": round(seconds, 1),
    }
    return {"summary": summary, "train_loss": losses, "loss_scale": scales}


def plot(runs: list[dict[str, Any]]) -> Figure:
    """Training loss per iteration (skipped steps marked) and the fp16 run's loss scale."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    by_loss, by_scale = fig.subplots(1, 2, sharex=True)
    for run in runs:
        summary, losses = run["summary"], run["train_loss"]
        line, = by_loss.plot(losses, linewidth=1, label=summary["run"])
        skipped = summary["skipped_at"]
        if skipped:
            by_loss.plot(skipped, [losses[i] for i in skipped], "x", color=line.get_color(), markersize=8,
                         label=f"{summary['run']}: skipped steps ({len(skipped)})")
        if summary["final_scale"] is not None:
            by_scale.plot(run["loss_scale"], color=line.get_color(), label=summary["run"])
    by_loss.set_yscale("log")
    by_loss.set_ylabel("training loss (batch)")
    by_scale.set_yscale("log", base=2)
    by_scale.set_ylabel("loss scale in force during backward")
    for ax in (by_loss, by_scale):
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("K-FAC on digits: fp32 vs fp16 autocast + GradScaler")
    return fig


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--init-scale", type=float, default=2.0**16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/amp_steps"), help="folder for the JSON and the plot")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = [train(fp16, args) for fp16 in (False, True)]
    for run in runs:
        print(json.dumps(run["summary"]))  # noqa: T201 (a command-line report)
    write_json_and_plot(args.out, "amp_steps", runs, plot(runs))
    return runs


if __name__ == "__main__":
    main()
