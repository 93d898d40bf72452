"""The command line: run the study, write JSON, a Markdown report and the log-log plot of steps vs batch.

Owns: arguments, progress, output files. Must not know: how a run trains (``study.py``) or the projection's
model (``projection.py``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter
from tqdm import tqdm

from benchmarks.large_batch import projection, study
from benchmarks.large_batch.tasks import STUDIES
from benchmarks.peers import optimizers
from benchmarks.peers.protocol import Runner

NAMES = {"sgd": "SGD", "adamw": "AdamW", "muon": "Muon", "soap": "SOAP", "kfac_dropin": "K-FAC drop-in",
         "kfac": "EigenAdam", "kfac_soap_m": "EigenAdam(beta1=0.9)",
         "kfac_soap_m_qr2": "EigenAdam(beta1=0.9, refresh=\"power\"), 1/2"}
"""The optimizers compared (peers' builders): ``kfac_dropin`` is ``KFAC(model, lr, momentum=0.9)`` with
every other default (the automatic intervals included); ``kfac`` the README's AdamW swap,
``method="eigen_adam"``, ``kl_clip=None``, with the defaults' intervals."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.large_batch", description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=list(STUDIES), default=list(STUDIES))
    parser.add_argument("--batches", nargs="+", type=int, default=[128, 512, 2048],
                        help="batch sizes (default 128 512 2048: 250 to 15 steps per epoch of 32k samples)")
    parser.add_argument("--optimizers", nargs="+", choices=optimizers.CHOICES, default=list(NAMES),
                        help="optimizers (peers' names; default: the six above, SOAP skipped without heavyball)")
    parser.add_argument("--grid-points", type=int, default=3,
                        help="lrs per optimizer, sqrt(10) apart (default 3; extended by one beyond an edge, up to "
                             f"{study.MAX_EXTENSIONS} times, while the chosen lr sits there)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds at the chosen lr (default 3)")
    parser.add_argument("--max-steps", type=int, default=400, help="steps per run at most (default 400)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each (default 2)")
    parser.add_argument("--quick", action="store_true", help="smoke test: cnn, batches 128 256, 1 lr, 1 seed, 30 steps")
    parser.add_argument("--out", type=Path, default=Path("runs") / "large_batch", help="output folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.tasks, args.batches, args.grid_points, args.seeds, args.max_steps = ["cnn"], [128, 256], 1, 1, 30
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in args.optimizers if optimizers.available(n)]
    skipped = sorted(set(args.optimizers) - set(names))
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                               "skipped": skipped, "tasks": {}}
    per_round = len(names) * len(args.batches) * args.grid_points
    with tqdm(total=per_round * len(args.tasks), unit="run", desc="large-batch runs") as bar:
        def done(run: study.Run) -> None:
            bar.set_postfix_str(f"{run['task']}/{run['optimizer']} b{run['batch']} lr {run['lr']:.3g}")
            bar.update()

        def run_all(specs: list[study.RunSpec]) -> list[study.Run]:
            bar.total = max(bar.total, bar.n + len(specs))
            return pool.map(specs)

        pool = Runner(args.jobs, done, run=study.train)
        try:
            for task in args.tasks:
                grid_runs, chosen = study.search(run_all, task, names, args.batches, args.grid_points, args.max_steps)
                seed_runs = run_all(study.seed_specs(chosen, args.seeds))
                rows = study.summarize(chosen, seed_runs)
                results["tasks"][task] = {"target": STUDIES[task].target, "rows": rows,
                                          "critical": critical(rows), "grid": grid_runs, "seeds": seed_runs}
        finally:
            pool.close()
    results["projection"] = projection.project()
    (args.out / "large_batch.json").write_text(json.dumps(results, indent=1, default=_json))
    report = render(results)
    (args.out / "large_batch.md").write_text(report)
    plot(results).savefig(args.out / "large_batch.png", dpi=110)
    print(report)
    return 0


def _json(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


def critical(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    by_name: dict[str, dict[int, float]] = {}
    for row in rows:
        by_name.setdefault(row["optimizer"], {})[row["batch"]] = row["median_steps"]
    return {name: study.critical_batch(steps) for name, steps in by_name.items()}


def _fmt(value: float, digits: int = 0) -> str:
    return "never" if not math.isfinite(value) else f"{value:.{digits}f}"


def render(results: dict[str, Any]) -> str:
    """The Markdown report: per task, one table per batch, the critical batches, then the projection."""
    settings = results["settings"]
    lines = [f"`python -m benchmarks.large_batch` ({settings['grid_points']}-point lr grids extended while the choice "
             f"sits at an edge, {settings['seeds']} seeds, "
             f"at most {settings['max_steps']} steps, batches {settings['batches']})", ""]
    if results["skipped"]:
        lines += [f"Skipped (not installed): {', '.join(results['skipped'])}.", ""]
    for task, data in results["tasks"].items():
        lines += [f"### {task}: {STUDIES[task].task.description}, to {data['target']:.0%} test accuracy", "",
                  "| batch | optimizer | lr | steps to target: median (seeds) | CPU ms/step | CPU s to target: median "
                  "| vs best peer (steps / time) |",
                  "|---|---|---|---|---|---|---|"]
        for batch in sorted({r["batch"] for r in data["rows"]}):
            rows = [r for r in data["rows"] if r["batch"] == batch]
            peers = [r for r in rows if not r["optimizer"].startswith("kfac")]
            best_steps = min((r["median_steps"] for r in peers), default=math.nan)
            best_time = min((r["median_s"] for r in peers), default=math.nan)
            for r in rows:
                ratio = (f"{r['median_steps'] / best_steps:.2f}x / {r['median_s'] / best_time:.2f}x"
                         if math.isfinite(r["median_steps"]) and math.isfinite(best_steps) and math.isfinite(best_time)
                         else "-")
                lines.append(f"| {batch} | {NAMES.get(r['optimizer'], r['optimizer'])} | {r['lr']:.3g} | "
                             f"{_fmt(r['median_steps'])} ({', '.join(_fmt(s) for s in r['steps'])}) | "
                             f"{r['step_ms']:.1f} | "
                             f"{_fmt(r['median_s'], 2)} | {ratio} |")
        lines += ["", "Critical batch (largest batch while doubling still cuts the steps by >= 1.5x): " + ", ".join(
            f"{NAMES.get(n, n)} {c if c is not None else 'never reached'}" for n, c in data["critical"].items()), ""]
    lines += projection.render(results["projection"])
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any]) -> Figure:
    tasks = list(results["tasks"])
    figure = Figure(figsize=(5.5 * len(tasks), 4.2))
    for index, task in enumerate(tasks):
        axis = figure.add_subplot(1, len(tasks), index + 1)
        rows = results["tasks"][task]["rows"]
        for name in dict.fromkeys(r["optimizer"] for r in rows):
            points = [(r["batch"], r["median_steps"]) for r in rows if r["optimizer"] == name
                      and math.isfinite(r["median_steps"])]
            if points:
                axis.plot(*zip(*points), marker="o", label=NAMES.get(name, name))
        batches = sorted({r["batch"] for r in rows})
        axis.set(xscale="log", yscale="log", xlabel="batch", ylabel="steps to target (median of seeds)",
                 title=f"{task}: to {results['tasks'][task]['target']:.0%} test accuracy")
        axis.set_xticks(batches, [str(b) for b in batches])
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    return figure
