"""Time for each run to reach a reference run's final metric, from ``examples.train`` output folders.

    python -m benchmarks.time_to_metric runs/digits_vit-seed0 runs/digits_vit-seed1 ... [--reference adamw]

For every folder (one seed of a config), reads ``<run>/metrics.jsonl`` (one line per epoch, with
``time_s``, the training time so far, and the config's metric), takes the reference run's final
metric value, and reports for every run the training time at the first epoch whose metric reaches
it (higher is better for accuracies, lower for losses and errors), that time over the reference
run's own time to it, and the run's mean step time over the reference's. Prints a table per
folder and the geometric mean of the ratios over folders, and writes them to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any


def higher_is_better(metric: str) -> bool:
    return metric.endswith("acc")


def read_runs(folder: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        path.parent.name: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for path in sorted(folder.glob("*/metrics.jsonl"))
    }


def first_time(history: list[dict[str, Any]], metric: str, value: float) -> float | None:
    """Training time at the first epoch whose ``metric`` reaches ``value``."""
    better = higher_is_better(metric)
    for row in history:
        if (row[metric] >= value) if better else (row[metric] <= value):
            return row["time_s"]
    return None


def mean_step(history: list[dict[str, Any]]) -> float:
    return statistics.fmean(row["step_s"] for row in history)


def compare(folder: Path, metric: str, reference: str) -> dict[str, Any]:
    runs = read_runs(folder)
    target = runs[reference][-1][metric]
    reference_time = first_time(runs[reference], metric, target)
    reference_step = mean_step(runs[reference])
    rows = {}
    for name, history in runs.items():
        reached = first_time(history, metric, target)
        rows[name] = {
            "time_s": reached,
            "time_ratio": None if reached is None else reached / reference_time,
            "step_ratio": mean_step(history) / reference_step,
            "final": history[-1][metric],
        }
    return {"folder": str(folder), "target": target, "runs": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+", help="examples.train output folders, one per seed")
    parser.add_argument("--metric", default="test_acc")
    parser.add_argument("--reference", default="adamw", help="the run whose final metric is the target")
    parser.add_argument("--out", type=Path, default=Path("time_to_metric.json"))
    args = parser.parse_args(argv)
    results = [compare(folder, args.metric, args.reference) for folder in args.folders]
    for result in results:
        print(f"\n{result['folder']}: target {args.metric} {result['target']:.4f} ({args.reference}'s final)")
        print(f"{'run':<8} {'time (s)':>9} {'vs ' + args.reference:>10} {'step vs ' + args.reference:>15} {'final':>7}")
        for name, row in result["runs"].items():
            time = "never" if row["time_s"] is None else f"{row['time_s']:.2f}"
            ratio = "-" if row["time_ratio"] is None else f"{row['time_ratio']:.2f}x"
            print(f"{name:<8} {time:>9} {ratio:>10} {row['step_ratio']:>14.2f}x {row['final']:>7.4f}")
    summary = {}
    for name in results[0]["runs"]:
        ratios = [r["runs"][name]["time_ratio"] for r in results if name in r["runs"]]
        steps = [r["runs"][name]["step_ratio"] for r in results if name in r["runs"]]
        reached = [x for x in ratios if x is not None]
        summary[name] = {
            "reached": f"{len(reached)}/{len(ratios)}",
            "time_ratio_geomean": math.exp(statistics.fmean(map(math.log, reached))) if reached else None,
            "step_ratio_geomean": math.exp(statistics.fmean(map(math.log, steps))),
        }
    print(f"\ngeometric means over {len(results)} folders: {json.dumps(summary)}")
    report = {"metric": args.metric, "reference": args.reference, "folders": results, "summary": summary}
    args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
