"""The command line: run the study, write JSON, a Markdown report and the log-log plot of steps vs batch.

A search is one optimizer's lr grid and its seeds on one task at one batch (``study.py``); the searches
run one after another, task by task in the order of ``--tasks``, then of ``--optimizers``, then of ``--batches``, and
``<out>/large_batch.json`` (every search: its runs and its row), ``.md`` and ``.png`` are rewritten after
each, so that an interrupted run keeps what it finished. A rerun with the same ``--out`` (and the same
``--grid-points``, ``--seeds`` and ``--max-steps``) skips the searches already in it; ``--merge`` joins
the files of a run made in pieces (``benchmarks.output``, as ``benchmarks.zoo``).

Owns: arguments, progress, output files. Must not know: how a run trains (``study.py``) or the projection's
model (``projection.py``).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter
from tqdm import tqdm

from benchmarks import output
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


RESUME_KEYS = ("grid_points", "seeds", "max_steps")
"""The settings a rerun into the same ``--out`` must share with the searches it resumes."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.large_batch", description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=list(STUDIES), default=list(STUDIES))
    parser.add_argument("--batches", nargs="+", type=int, default=[128, 512, 2048],
                        help="batch sizes (default 128 512 2048: 250 to 15 steps per epoch of 32k samples)")
    parser.add_argument("--optimizers", nargs="+", choices=optimizers.CHOICES, default=list(NAMES),
                        help="optimizers (peers' names; default: the eight above, SOAP skipped without heavyball), "
                             "searched in this order on each task, each at every batch")
    parser.add_argument("--grid-points", type=int, default=3,
                        help="lrs per optimizer, sqrt(10) apart (default 3; extended by one beyond an edge, up to "
                             f"{study.MAX_EXTENSIONS} times, while the chosen lr sits there)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds at the chosen lr (default 3)")
    parser.add_argument("--max-steps", type=int, default=400, help="steps per run at most (default 400)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel, one thread each (default 2)")
    parser.add_argument("--quick", action="store_true", help="smoke test: cnn, batches 128 256, 1 lr, 1 seed, 30 steps")
    parser.add_argument("--out", type=Path, default=Path("runs") / "large_batch",
                        help="output folder; a rerun into it skips the searches its large_batch.json holds")
    parser.add_argument("--merge", nargs="+", type=Path, default=None, metavar="FOLDER",
                        help="train nothing: join these folders' large_batch.json (a run made in pieces) into --out")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    if args.quick:
        args.tasks, args.batches, args.grid_points, args.seeds, args.max_steps = ["cnn"], [128, 256], 1, 1, 30
    return args


def _load(folder: Path, args: argparse.Namespace, required: bool = False) -> dict[str, Any]:
    """The payload saved in ``folder`` (a fresh one if none and not ``required``); refuses other settings."""
    path = folder / "large_batch.json"
    try:
        saved = output.load_finished(path, vars(args), RESUME_KEYS)
    except ValueError as error:
        _parser().error(str(error))
    if saved is None and required:
        _parser().error(f"{path} does not exist")
    return saved or {"searches": {}, "skipped": []}


def search_name(optimizer: str, batch: int) -> str:
    """The key of one search within its task: ``"<optimizer> <batch>"``."""
    return f"{optimizer} {batch}"


def main(argv: list[str] | None = None) -> int:
    """The searches of the arguments not yet in ``--out`` (or ``--merge``'s join), then the report; each
    search is written (JSON, Markdown, plot) as soon as it is finished."""
    args = parse_args(argv)
    saved = _load(args.out, args)
    names = [n for n in args.optimizers if optimizers.available(n)]
    payload: dict[str, Any] = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "skipped": sorted(set(saved["skipped"]) | (set(args.optimizers) - set(names))),
        "searches": saved["searches"], "projection": projection.project()}
    if args.merge:
        for folder in args.merge:
            more = _load(folder, args, required=True)
            twice = output.join_searches(payload["searches"], more["searches"])
            if twice:
                _parser().error(f"{folder} repeats searches already joined: {twice}")
            payload["skipped"] = sorted(set(payload["skipped"]) | set(more["skipped"]))
        _write(args.out, payload)
        print(render(payload))  # noqa: T201 (a command-line report)
        return 0
    todo = [(name, task, batch) for task in args.tasks for name in names for batch in args.batches
            if search_name(name, batch) not in payload["searches"].get(task, {})]
    with tqdm(total=len(todo) * (args.grid_points + args.seeds - 1), unit="run", desc="large-batch runs") as bar:
        if len(todo) < len(names) * len(args.tasks) * len(args.batches):
            bar.write(f"{args.out}: resuming, {len(todo)} searches to go")
        def done(run: study.Run) -> None:
            bar.set_postfix_str(f"{run['task']}/{run['optimizer']} b{run['batch']} lr {run['lr']:.3g}")
            bar.update()

        def run_all(specs: list[study.RunSpec]) -> list[study.Run]:
            bar.total = max(bar.total, bar.n + len(specs))
            return pool.map(specs)

        pool = Runner(args.jobs, done, run=study.train)
        try:
            for index, (name, task, batch) in enumerate(todo, 1):
                grid_runs, chosen = study.search(run_all, task, [name], [batch], args.grid_points, args.max_steps)
                seed_runs = run_all(study.seed_specs(chosen, args.seeds))
                (row,) = study.summarize(chosen, seed_runs)
                payload["searches"].setdefault(task, {})[search_name(name, batch)] = {
                    "optimizer": name, "batch": batch, "row": row, "grid": grid_runs, "seeds": seed_runs}
                _write(args.out, payload)
                bar.write(f"search {index}/{len(todo)} done: {task} {name} batch {batch}: lr {row['lr']:.3g}, "
                          f"steps {_fmt(row['median_steps'])} ({', '.join(_fmt(s) for s in row['steps'])}), "
                          f"CPU s {_fmt(row['median_s'], 2)}")
        finally:
            pool.close()
    if not todo:
        _write(args.out, payload)
    print(render(payload))  # noqa: T201 (a command-line report)
    return 0


def _write(out: Path, payload: dict[str, Any]) -> None:
    """The report of every search in ``payload`` so far: ``tasks`` (per task the target, the rows in the
    order of :data:`NAMES`, the critical batches) into ``payload``, then the JSON, Markdown and plot."""
    order = {name: index for index, name in enumerate(NAMES)}
    payload["tasks"] = {}
    for task in (t for t in STUDIES if t in payload["searches"]):
        rows = sorted((s["row"] for s in payload["searches"][task].values()),
                      key=lambda r: (r["batch"], order.get(r["optimizer"], len(order)), r["optimizer"]))
        payload["tasks"][task] = {"target": STUDIES[task].target, "rows": rows, "critical": critical(rows)}
    output.write_json_whole(out / "large_batch.json", payload)
    (out / "large_batch.md").write_text(render(payload))
    plot(payload).savefig(out / "large_batch.png", dpi=110)


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
