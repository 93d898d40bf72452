"""Per-epoch records on disk (JSON lines) and the summary table of the runs compared.

A record is one epoch of one run: `epoch` (epochs completed), `step` (optimizer steps done),
`lr`, `train_loss`, the evaluated metrics (`test_loss`, `test_acc` for classifiers; `train_mse`,
`test_mse` for the autoencoder), `time_s` (cumulative training time: forward, backward, step and
data loading, without evaluation or checkpointing), `epoch_s`, `step_s` (mean per optimizer
step) and `images_per_s` (global, training).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def write_records(path: Path, records: Sequence[Record]) -> None:
    """Write `records` as JSON lines, replacing the file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def append_record(path: Path, record: Record) -> None:
    """Append one record as a JSON line."""
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_records(path: Path) -> list[Record]:
    """The records of a JSON-lines file."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def reached(value: float, target: float, higher_is_better: bool) -> bool:
    """Whether a metric value meets the target."""
    return value >= target if higher_is_better else value <= target


@dataclass(frozen=True)
class Summary:
    """What the table says about one run."""

    run: str
    epochs: int
    final: float
    best: float
    time_to_target_s: float | None
    epochs_to_target: int | None
    mean_step_s: float
    train_time_s: float


def summarize(run: str, records: Sequence[Record], metric: str, target: float | None,
              higher_is_better: bool) -> Summary:
    """Final and best metric, first epoch at the target (and its training time), mean step time."""
    values = [r[metric] for r in records]
    hit = next((r for r in records if target is not None and reached(r[metric], target, higher_is_better)), None)
    return Summary(
        run=run,
        epochs=records[-1]["epoch"],
        final=values[-1],
        best=max(values) if higher_is_better else min(values),
        time_to_target_s=hit["time_s"] if hit else None,
        epochs_to_target=hit["epoch"] if hit else None,
        mean_step_s=records[-1]["time_s"] / records[-1]["step"],
        train_time_s=records[-1]["time_s"],
    )


def summarize_runs(histories: Mapping[str, Sequence[Record]], metric: str, target: float | None,
                   higher_is_better: bool) -> tuple[list[Summary], str]:
    """Summaries of the runs (first one the baseline) against a goal, and the goal's label.

    The goal is `target`; a config without one (a fixed time budget) is compared at the first
    run's final value instead: how long each run takes to do as well as the baseline did at the end.
    """
    if target is None:
        name, records = next(iter(histories.items()))
        target = summarize(name, records, metric, None, higher_is_better).final
        goal = f"{name}'s final {metric} {target:.4g}"
    else:
        goal = f"{metric} {target:g}"
    return [summarize(name, records, metric, target, higher_is_better) for name, records in histories.items()], goal


def format_table(summaries: Sequence[Summary], metric: str, goal: str | None, baseline: str | None = None) -> str:
    """A Markdown table, one row per run; time ratios are relative to the first row (named `baseline`).

    With a `goal` (the label of the target the summaries were made against) it has the time and
    epochs to that goal and their ratio; without one, only the final and best values and times.
    """
    head = ["run", "epochs", f"final {metric}", f"best {metric}"]
    if goal is not None:
        head += [f"time to {goal} (s)", "epochs to it", f"vs {baseline or summaries[0].run}"]
    head += ["mean step (ms)", "train time (s)"]
    base = summaries[0].time_to_target_s
    rows = []
    for s in summaries:
        row = [s.run, str(s.epochs), f"{s.final:.4f}", f"{s.best:.4f}"]
        if goal is not None:
            reached_it = s.time_to_target_s is not None
            row += [f"{s.time_to_target_s:.2f}" if reached_it else "not reached",
                    str(s.epochs_to_target) if reached_it else "-",
                    f"{s.time_to_target_s / base:.2f}x" if reached_it and base else "-"]
        row += [f"{1e3 * s.mean_step_s:.1f}", f"{s.train_time_s:.2f}"]
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])
