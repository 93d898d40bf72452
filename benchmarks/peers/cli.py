"""The command line: run the protocol, print and write the tables, the JSON and the plots."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.output import write_json_and_plot
from benchmarks.peers import __doc__ as PACKAGE_DOC
from benchmarks.peers import analysis, optimizers
from benchmarks.peers.protocol import Run, Runner, tune_and_seed
from benchmarks.peers.tasks import TASKS

QUICK_BUDGET_SCALE = 0.05


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=PACKAGE_DOC.split("\n\n")[0],
                                     epilog="Method: " + PACKAGE_DOC.split("\n\n", 2)[2],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS), help="tasks (default: all)")
    parser.add_argument("--optimizers", nargs="+", choices=optimizers.CHOICES, default=list(optimizers.OPTIMIZERS),
                        help=f"optimizers (default: {' '.join(optimizers.OPTIMIZERS)}; soap is skipped with a note "
                        f"without heavyball; K-FAC variants on request: {' '.join(optimizers.KFAC_VARIANTS)})")
    parser.add_argument("--grid-points", type=int, default=None,
                        help="learning rates per optimizer (default 4; --quick: 1)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds of the best lr (default 3; --quick: 1)")
    parser.add_argument("--budget-scale", type=float, default=None,
                        help=f"multiplies every task's training-time budget (default 1; --quick: {QUICK_BUDGET_SCALE})")
    parser.add_argument("--evals", type=int, default=None,
                        help="evaluations per run after time 0 (default 20; --quick: 3)")
    parser.add_argument("--jobs", type=int, default=2,
                        help="runs in parallel, one thread each (default 2; 1: in this process)")
    parser.add_argument("--quick", action="store_true", help="tiny budget for a smoke test (CI)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "peers", help="output folder (default runs/peers)")
    parser.add_argument("--report", action="store_true",
                        help="train nothing: re-read the runs of --out's <task>.json files and rewrite the tables, "
                        "summaries and plots")
    args = parser.parse_args(argv)
    quick = args.quick
    for name, normal, small in (("grid_points", 4, 1), ("seeds", 3, 1), ("budget_scale", 1.0, QUICK_BUDGET_SCALE),
                                ("evals", 20, 3)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else normal)
    if args.grid_points < 1 or args.seeds < 1 or args.evals < 1 or args.jobs < 1 or args.budget_scale <= 0:
        parser.error("--grid-points, --seeds, --evals and --jobs must be >= 1 and --budget-scale > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    command = " ".join(["python -m benchmarks.peers", *(argv if argv is not None else sys.argv[1:])])
    if args.report:
        return report(args, command)
    names = [n for n in dict.fromkeys(args.optimizers) if optimizers.available(n)]
    for skipped in sorted(set(args.optimizers) - set(names)):
        print(f"note: {skipped} skipped: heavyball is not installed (pip install heavyball, or .[peers])")
    tasks = list(dict.fromkeys(args.tasks))
    total = len(tasks) * len(names) * (args.grid_points + args.seeds - 1)
    started, load = time.perf_counter(), os.getloadavg()[0]
    warned: dict[str, set[str]] = {}
    bar = tqdm(total=total, desc="peer runs", unit="run", dynamic_ncols=True)

    def done(run: Run) -> None:
        bar.set_postfix_str(f"{run['task']}/{run['optimizer']} lr {run['lr']:g} seed {run['seed']}")
        bar.update()
        warned.setdefault(run["optimizer"], set()).update(run["warnings"])

    runner = Runner(args.jobs, done)
    results, infos = {}, {}
    try:
        for task in tasks:  # each task's files are written as soon as it is done
            results[task] = tune_and_seed(runner, task, names, args.grid_points, args.seeds, args.budget_scale,
                                          args.evals)
            infos[task] = {**settings(args, names), "command": command, "wall_s": time.perf_counter() - started,
                           "load_start": load, "load_end": os.getloadavg()[0]}
            bar.clear()
            write(args.out, results, infos, command)
    finally:
        runner.close()
        bar.close()
    for name, messages in sorted(warned.items()):
        for message in sorted(messages):
            print(f"warning from {name} runs: {message}")
    return 0


def report(args: argparse.Namespace, command: str) -> int:
    """``--report``: the tables and plots of the runs saved in ``args.out``."""
    saved = {task: json.loads((args.out / f"{task}.json").read_text()) for task in args.tasks
             if (args.out / f"{task}.json").is_file()}
    if not saved:
        print(f"no <task>.json for tasks {args.tasks} in {args.out}", file=sys.stderr)
        return 1
    write(args.out, {t: p["runs"] for t, p in saved.items()}, {t: p["settings"] for t, p in saved.items()}, command)
    return 0


def write(out: Path, results: dict[str, dict[str, Any]], infos: dict[str, dict[str, Any]], command: str) -> None:
    """Per task: the table, ``<task>.json`` (summary, every run, settings) and ``<task>.png``; then ``peers.md``."""
    summaries, tables = [], []
    for task, runs in results.items():
        summary = analysis.summarize_task(TASKS[task], runs)
        summaries.append(summary)
        tables.append(analysis.format_table(summary))
        write_json_and_plot(out, task, {"summary": summary, "runs": runs, "settings": infos[task]},
                            analysis.plot_task(summary, runs))
    runs_line = [f"{task}: done {i['wall_s'] / 60:.1f} min after the start of `{i['command']}` (--jobs {i['jobs']}), "
                 f"load average {i['load_start']:.2f} at the start and {i['load_end']:.2f} then"
                 for task, i in infos.items() if "wall_s" in i]
    text = "\n\n".join([
        f"`{command}`", *tables,
        "The benchmark's goals for K-FAC, as measured:\n\n"
        + "\n".join(f"- {line}" for line in analysis.kfac_verdicts(summaries)),
        "Runs:\n\n" + "\n".join(f"- {line}" for line in runs_line) if runs_line else "Runs: (no timing recorded)",
    ])
    print("\n" + text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.md").write_text(text + "\n", encoding="utf-8")
    print(f"wrote {out / 'peers.md'}")


def settings(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """What the JSON records of the protocol, beside the runs."""
    return {"grid_points": args.grid_points, "seeds": args.seeds, "budget_scale": args.budget_scale,
            "evals": args.evals, "jobs": args.jobs, "optimizers": names,
            "grids": {n: optimizers.lr_grid(n, args.grid_points) for n in names},
            "kfac_settings": optimizers.KFAC_SETTINGS,
            "kfac_variants": {n: {k: repr(v) for k, v in optimizers.KFAC_VARIANTS[n].items()}
                              for n in names if n in optimizers.KFAC_VARIANTS},
            "budgets_s": {t: TASKS[t].budget_s * args.budget_scale for t in args.tasks},
            "batch_sizes": {t: TASKS[t].batch_size for t in args.tasks}}
