"""The main job: K-FAC against SGD (and AdamW) on both digits tasks, and where K-FAC wins.

    python -m benchmarks.digits                 # ~1.5 minutes on 2 CPU cores
    python -m benchmarks.digits --out-dir runs/main

Trains, through the training application (`python -m examples.train`), the runs of
configs/digits.yaml (8x8 digits classifier, small CNN: SGD vs K-FAC, time to 97% test accuracy)
and configs/digits_autoencoder.yaml (deep autoencoder: SGD, AdamW and K-FAC for 15 s of training
each). Prints each config's table, then one summary: for every K-FAC run and every other run of
the same task, how long K-FAC takes to reach that run's goal (the config's target, or the other
run's final value when the config has a time budget instead) against that run's own time, with
epochs and per-step cost beside it. Writes summary.md, the plots and the runs' JSON lines under
--out-dir.

Each config is trained exactly as `python -m examples.train --config configs/<task>.yaml` trains it,
so the two commands report the same times. Both configs set `train.clock: cpu`: the training
process's CPU time (one thread, one process), which is what an idle machine's wall clock would
show and does not move when other jobs share the machine; `--set train.clock=wall` measures
wall-clock time instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from examples import train
from examples.training.config import load_experiment
from examples.training.report import Record, read_records, summarize

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TASKS = (CONFIGS / "digits.yaml", CONFIGS / "digits_autoencoder.yaml")
KFAC_RUN = "kfac"


def comparison_rows(task: str, histories: dict[str, list[Record]], metric: str, target: float | None,
                    higher_is_better: bool) -> list[dict[str, object]]:
    """K-FAC against every other run of one task, at that run's goal (see the module docstring)."""
    kfac = histories[KFAC_RUN]
    rows = []
    for name, records in histories.items():
        if name == KFAC_RUN:
            continue
        other = summarize(name, records, metric, target, higher_is_better)
        goal_value = target if target is not None else other.final
        goal = f"{metric} {goal_value:g}" if target is not None else f"{name}'s final {metric} {goal_value:.4g}"
        other = summarize(name, records, metric, goal_value, higher_is_better)
        ours = summarize(KFAC_RUN, kfac, metric, goal_value, higher_is_better)
        ratio = (ours.time_to_target_s / other.time_to_target_s
                 if ours.time_to_target_s is not None and other.time_to_target_s else None)
        rows.append({
            "task": task, "versus": name, "goal": goal,
            "kfac_s": ours.time_to_target_s, "other_s": other.time_to_target_s, "time_ratio": ratio,
            "kfac_epochs": ours.epochs_to_target, "other_epochs": other.epochs_to_target,
            "step_ratio": ours.mean_step_s / other.mean_step_s,
            "kfac_final": ours.final, "other_final": other.final,
        })
    return rows


def verdict(row: dict[str, object]) -> str:
    ratio = row["time_ratio"]
    if ratio is None:
        return "K-FAC loses (never reaches it)" if row["kfac_s"] is None else "K-FAC wins (the other never reaches it)"
    return "K-FAC wins" if ratio < 1 else "K-FAC loses"


def format_summary(rows: Sequence[dict[str, object]]) -> str:
    """One Markdown table: where K-FAC wins and where it does not."""
    def seconds(value: object) -> str:
        return "not reached" if value is None else f"{value:.2f}"

    head = ["task", "K-FAC vs", "goal", "K-FAC time (s)", "its time (s)", "time ratio", "epochs (K-FAC / it)",
            "step cost ratio", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratio = "-" if r["time_ratio"] is None else f"{r['time_ratio']:.2f}x"
        epochs = f"{r['kfac_epochs'] if r['kfac_epochs'] is not None else '-'} / " \
                 f"{r['other_epochs'] if r['other_epochs'] is not None else '-'}"
        cells = [r["task"], r["versus"], r["goal"], seconds(r["kfac_s"]), seconds(r["other_s"]), ratio, epochs,
                 f"{r['step_ratio']:.2f}x", verdict(r)]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.digits", description=__doc__.split("\n\n")[0],
                                     epilog="Each task's own options: python -m examples.train --help")
    parser.add_argument("--out-dir", type=Path, default=Path("runs") / "main_job", help="output folder")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key in both tasks (as python -m examples.train --set)")
    args = parser.parse_args(argv)
    overrides = args.overrides

    rows: list[dict[str, object]] = []
    for config in TASKS:
        try:
            experiment = load_experiment(config, overrides)
        except (ValueError, FileNotFoundError) as err:
            parser.error(str(err))
        out_dir = args.out_dir / experiment.name
        print(f"\n## {experiment.name} ({config.relative_to(CONFIGS.parent)})\n", flush=True)
        sets = [item for key_value in overrides for item in ("--set", key_value)]
        status = train.main(["--config", str(config), "--out-dir", str(out_dir), *sets])
        if status:
            return status
        histories = {run.name: read_records(out_dir / run.name / "metrics.jsonl") for run in experiment.runs}
        cfg = experiment.runs[0].train
        rows += comparison_rows(experiment.name, histories, cfg.metric, cfg.target, cfg.higher_is_better)

    summary = format_summary(rows)
    print("\n## Where K-FAC wins and where it does not\n")
    print(summary)
    print("\ntime ratio: K-FAC's training time to the goal over the other run's; step cost ratio: K-FAC's mean "
          "step time over the other run's (K-FAC's steps cost more; it wins when it needs enough fewer of them).")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "summary.md").write_text(f"`python -m benchmarks.digits`\n\n{summary}\n", encoding="utf-8")
    print(f"\nwrote {args.out_dir}/: summary.md, <task>/plot.png, <task>/summary.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
