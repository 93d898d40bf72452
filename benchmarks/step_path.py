"""Which of the package's files one default step runs (``python -m benchmarks.step_path``).

A small MLP trains two warm-up steps under ``KFAC(model)`` with every default (its automatic
intervals: factors every 2nd step, decompositions every 10th); then ``--steps`` more steps
(``backward()`` and ``step()``) run under :func:`sys.setprofile`, and every Python function entered
is attributed to its source file. Prints the files of ``kfac_optim`` those steps entered, grouped
by folder, and writes ``<out>/step_path.json`` with a bar chart of files per folder
(``step_path.png``). The count says how many modules a reader follows from ``backward()`` to the
parameters' update over one cycle of the default intervals; it does not measure cost.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from matplotlib.figure import Figure
from torch import nn

import kfac_optim
from benchmarks.output import write_json_and_plot

PACKAGE = Path(kfac_optim.__file__).resolve().parent


def files_entered(steps: int, seed: int = 0) -> list[str]:
    """The package's source files (relative to the package, sorted) that ``steps`` default steps enter."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = kfac_optim.KFAC(model, lr=0.1)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def train_step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(2):  # construction-time work and the first step's one-time checks stay out
        train_step()
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        for _ in range(steps):
            train_step()
    finally:
        sys.setprofile(None)
    inside = {Path(name).resolve() for name in seen}
    return sorted(path.relative_to(PACKAGE).as_posix() for path in inside if PACKAGE in path.parents)


def _figure(by_folder: dict[str, list[str]]) -> Figure:
    figure = Figure(figsize=(6, 3.5))
    axes = figure.subplots()
    folders = sorted(by_folder)
    axes.bar(folders, [len(by_folder[folder]) for folder in folders])
    axes.set_ylabel("files entered by one step")
    axes.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    return figure


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="steps traced after two warm-up steps")
    parser.add_argument("--out", type=Path, default=Path("runs/step_path"), help="folder for the JSON and plot")
    args = parser.parse_args(argv)
    files = files_entered(args.steps)
    by_folder: dict[str, list[str]] = defaultdict(list)
    for name in files:
        by_folder[name.rpartition("/")[0] or "(root)"].append(name)
    for folder in sorted(by_folder):
        print(f"{folder:14s} {len(by_folder[folder]):3d}  {', '.join(by_folder[folder])}")  # noqa: T201
    print(f"{len(files)} files, {len(by_folder.get('(root)', []))} at the package root")  # noqa: T201
    payload = {"steps": args.steps, "files": files, "by_folder": dict(by_folder)}
    write_json_and_plot(args.out, "step_path", payload, _figure(by_folder))
    return payload


if __name__ == "__main__":
    main()
