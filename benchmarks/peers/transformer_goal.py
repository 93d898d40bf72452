"""EigenAdam's documented transformer recipe against AdamW and Muon, from saved peer runs.

    python -m benchmarks.peers.transformer_goal DIR [DIR ...] [--split val] [--out goal.md]

reads the ``<task>.json`` files that ``python -m benchmarks.peers --out DIR`` wrote (a task's runs from
several commands merge; an optimizer may come from one of them only) and reports, per task and per
K-FAC configuration among them (``kfac_ema`` is the recipe: `benchmarks.peers.optimizers`), on the
``split`` metric (validation by default; lower is better on the language tasks), then each merged
task's table of `benchmarks.peers.analysis` (test metric):

- **time to AdamW's final**: the median over seeds of the configuration's training CPU time to AdamW's
  median final metric, over AdamW's own median time to it (about its budget); goal ≤ 0.6×.
- **steps to Muon's final**: the configuration's median step count to Muon's median final metric,
  against Muon's median steps to it; goal: fewer (steps, not time: `torch.optim.Muon` runs its
  Newton-Schulz iteration in bf16, which a CPU without native bf16 emulates, so its CPU time is inflated).
- **steps to AdamW's final** (information): the configuration's median steps to AdamW's median
  final, against AdamW's.
- **lr at an edge**: whether the configuration's chosen lr is the first or last of its grid, as grown
  by the protocol (`benchmarks.peers.protocol.search`); goal: not.

Between two evaluations the metric is taken as linear in time and in steps (`analysis.time_to`).
It owns only this reading of the runs; it must not know how they were produced.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from benchmarks.peers.analysis import KFAC, format_table, median, median_final, summarize_task, time_to
from benchmarks.peers.protocol import final
from benchmarks.peers.tasks import TASKS

TIME_GOAL = 0.6
"""The recipe's time to AdamW's final, as a fraction of AdamW's, at most."""


def merged_runs(folders: list[Path]) -> dict[str, dict[str, Any]]:
    """``{task: {optimizer: results}}`` from every ``<task>.json`` under ``folders``."""
    tasks: dict[str, dict[str, Any]] = {}
    for path in sorted(p for folder in folders for p in folder.glob("*.json")):
        if path.stem not in TASKS:
            continue
        runs = json.loads(path.read_text())["runs"]
        task = tasks.setdefault(path.stem, {})
        if clash := set(task) & set(runs):
            raise ValueError(f"folders: {path} repeats optimizers {sorted(clash)} of task {path.stem!r}")
        task.update(runs)
    return tasks


def _to(results: dict[str, Any], target: float, hib: bool, split: str, clock: str) -> float:
    return median([time_to(r["history"], target, hib, split=split, clock=clock) for r in results["seeds"]])


def measure(task: str, results: dict[str, dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """One row per K-FAC configuration of ``task`` (needs ``adamw`` and ``muon`` among ``results``)."""
    hib = TASKS[task].higher_is_better
    adamw, muon = results["adamw"], results["muon"]
    adamw_final, muon_final = median_final(adamw["seeds"], hib, split), median_final(muon["seeds"], hib, split)
    adamw_time = _to(adamw, adamw_final, hib, split, "time_s")
    adamw_steps = _to(adamw, adamw_final, hib, split, "step")
    muon_steps = _to(muon, muon_final, hib, split, "step")
    rows = []
    for name, res in results.items():
        if not name.startswith(KFAC):
            continue
        lrs = [r["lr"] for r in res["grid"]]
        to_adamw = _to(res, adamw_final, hib, split, "time_s")
        steps = _to(res, muon_final, hib, split, "step")
        ratio = to_adamw / adamw_time
        at_edge = len(lrs) > 1 and res["best_lr"] in (lrs[0], lrs[-1])
        rows.append({
            "task": task, "optimizer": name, "lr": res["best_lr"], "grid": lrs, "lr_at_edge": at_edge,
            "final": median_final(res["seeds"], hib, split), "finals": [final(r, split) for r in res["seeds"]],
            "adamw_final": adamw_final, "adamw_lr": adamw["best_lr"], "muon_final": muon_final,
            "muon_lr": muon["best_lr"], "to_adamw_s": to_adamw, "adamw_s": adamw_time, "time_ratio": ratio,
            "to_muon_steps": steps, "muon_steps": muon_steps,
            "to_adamw_steps": _to(res, adamw_final, hib, split, "step"), "adamw_steps": adamw_steps,
            "step_ms": {n: 1e3 * median([r["step_s"] for r in results[n]["seeds"]]) for n in ("adamw", "muon", name)},
            "met": {"time": ratio <= TIME_GOAL, "steps": steps < muon_steps, "lr_inside": not at_edge},
        })
    return rows


def _n(value: float, digits: int = 1) -> str:
    return "never" if math.isinf(value) else f"{value:.{digits}f}"


def table(rows: list[dict[str, Any]], split: str) -> str:
    """The rows as one Markdown table."""
    head = ["task", "K-FAC", "lr (grid)", f"final {split}: K-FAC (seeds) / AdamW / Muon",
            "time to AdamW's final: K-FAC / AdamW (s)", f"ratio (goal ≤ {TIME_GOAL}×)",
            "steps to Muon's final: K-FAC / Muon (goal fewer)", "steps to AdamW's final: K-FAC / AdamW",
            "step ms: K-FAC / AdamW / Muon", "goals met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms = r["step_ms"]
        grid = "/".join(f"{lr:g}" for lr in r["grid"])
        met = ", ".join(f"{goal} {'yes' if ok else 'NO'}" for goal, ok in r["met"].items())
        lines.append("| " + " | ".join([
            r["task"], r["optimizer"], f"**{r['lr']:g}** ({grid}){' edge' if r['lr_at_edge'] else ''}",
            f"{r['final']:.4f} ({', '.join(f'{v:.4f}' for v in r['finals'])}) / {r['adamw_final']:.4f} / "
            f"{r['muon_final']:.4f}",
            f"{_n(r['to_adamw_s'])} / {_n(r['adamw_s'])}",
            "never" if math.isinf(r["time_ratio"]) else f"{r['time_ratio']:.2f}×",
            f"{_n(r['to_muon_steps'], 0)} / {_n(r['muon_steps'], 0)}",
            f"{_n(r['to_adamw_steps'], 0)} / {_n(r['adamw_steps'], 0)}",
            f"{ms[r['optimizer']]:.0f} / {ms['adamw']:.0f} / {ms['muon']:.0f}", met]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers.transformer_goal",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="output folders of python -m benchmarks.peers")
    parser.add_argument("--split", choices=("val", "test"), default="val", help="the metric's split (default val)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table and the rows (JSON) here")
    args = parser.parse_args(argv)
    merged = merged_runs(args.folders)
    rows = [row for task, results in merged.items() for row in measure(task, results, args.split)]
    peers_tables = [format_table(summarize_task(TASKS[task], results)) for task, results in merged.items()]
    text = "\n\n".join([table(rows, args.split), *peers_tables])
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
