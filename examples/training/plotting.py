"""The comparison plot: a run's metric against training wall-clock time and against epochs.

Uses matplotlib's object API (no pyplot, no global state, no display needed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from examples.training.report import Record


def plot_runs(histories: Mapping[str, Sequence[Record]], metric: str, target: float | None,
              higher_is_better: bool, title: str, path: Path, clock: str = "wall") -> None:
    """Two panels, `metric` vs training time (s; `clock` "cpu": CPU time) and vs epoch, one line per
    run; write a PNG."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    by_time, by_epoch = fig.subplots(1, 2, sharey=True)
    for run, records in histories.items():
        values = [r[metric] for r in records]
        by_time.plot([r["time_s"] for r in records], values, marker=".", label=run)
        by_epoch.plot([r["epoch"] for r in records], values, marker=".", label=run)
    time_label = "training CPU time (s)" if clock == "cpu" else "training time (s)"
    for ax, xlabel in ((by_time, time_label), (by_epoch, "epoch")):
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    by_time.set_ylabel(metric)
    if higher_is_better and target is not None:
        by_time.set_ylim(bottom=max(0.0, target - 0.1), top=1.0)
    elif not higher_is_better:
        by_time.set_yscale("log")
    by_epoch.legend()
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
