"""Grid search over a config's runs under one budget, so that the compared runs are each tuned.

    python -m examples.sweep --config configs/digits.yaml \\
        --grid sgd.optim.lr=0.03,0.1,0.3 --grid kfac.optim.lr=0.03,0.1,0.3 \\
        --grid kfac.optim.kfac.damping=0.01,0.1,1

Every run of the config trains once per combination of the grid values that apply to it
(`RUN.section.key=...` for one run, `section.key=...` for all), with the config's own budget
(epochs, time_budget_s), seed and data, checkpoints off. A combination ranks by the training
time to the config's target when it reaches it, else by its final metric. Prints one table per
run and writes them, with the best settings as `--set` overrides, to OUT/sweep.md.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
from pathlib import Path

from examples.train import DEFAULT_CONFIG
from examples.training.config import SECTIONS, SetupError, load_experiment, parse_override


def parse_grid(text: str) -> tuple[str, list[str]]:
    """`KEY=v1,v2` -> (KEY, ["v1", "v2"]); each value is read as YAML when applied."""
    key, sep, values = text.partition("=")
    if not sep or not values:
        raise ValueError(f"--grid {text!r} is not KEY=V1,V2,... (e.g. optim.lr=0.03,0.1,0.3)")
    parse_override(f"{key}=0")  # validates the key's shape
    return key, values.split(",")


def grid_for(run: str, grid: dict[str, list[str]]) -> dict[str, list[str]]:
    """The grid axes that apply to `run`, as run-specific keys."""
    axes = {}
    for key, values in grid.items():
        head = key.split(".")[0]
        if head in SECTIONS:
            axes[f"{run}.{key}"] = values
        elif head == run:
            axes[key] = values
    return axes


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m examples.sweep", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="YAML config (default: configs/digits.yaml)")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="values to try (repeatable)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="fixed override for every combination (as in train.py)")
    parser.add_argument("--runs", nargs="+", metavar="RUN", help="sweep only these runs")
    parser.add_argument("--out-dir", type=Path, help="output folder (default: runs/<config name>-sweep)")
    args = parser.parse_args(argv)
    try:
        grid = dict(map(parse_grid, args.grid))
        overrides = [*args.overrides, "train.checkpoint=false"]
        experiment = load_experiment(args.config, overrides, args.runs)
        unknown = {key.split(".")[0] for key in grid} - set(SECTIONS) - {run.name for run in experiment.runs}
        if unknown:
            raise ValueError(f"--grid names no run or section: {', '.join(sorted(unknown))}")
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))

    from examples.training import process_group
    from examples.training.report import format_table, summarize
    from examples.training.trainer import Trainer, preflight

    env = process_group.setup(experiment.runs[0].train.device)
    out_dir = args.out_dir or Path("runs") / f"{experiment.name}-sweep"
    train = experiment.runs[0].train
    goal = f"{train.metric} {train.target:g}" if train.target is not None else None
    sections = [f"`{shlex.join(['python', '-m', 'examples.sweep', *(sys.argv[1:] if argv is None else argv)])}`"]
    for base in experiment.runs:
        axes = grid_for(base.name, grid)
        scored = []
        for values in itertools.product(*axes.values()):
            sets = [f"{key}={value}" for key, value in zip(axes, values)]
            label = " ".join(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in zip(axes, values)) or "(config)"
            try:
                (run,) = load_experiment(args.config, [*overrides, *sets], [base.name]).runs
                preflight(run, env)
                history = Trainer(run, env, out_dir / base.name / f"{len(scored):03d}").run(resume=False)
            except (SetupError, ValueError) as err:
                print(f"{parser.prog}: error: {label}: {err}", file=sys.stderr)
                return 2
            summary = summarize(label, history, train.metric, train.target, train.higher_is_better)
            scored.append((summary, sets))
        sign = -1 if train.higher_is_better else 1
        scored.sort(key=lambda item: (item[0].time_to_target_s is None, item[0].time_to_target_s or 0.0,
                                      sign * item[0].final))
        table = format_table([summary for summary, _ in scored], train.metric, goal, baseline="best")
        best = " ".join(f"--set {s}" for s in scored[0][1]) or "(the config as is)"
        section = f"## {base.name}\n\nbest: `{best}`\n\n{table}\n"
        sections.append(section)
        if env.is_main:
            print(section)
    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "sweep.md").write_text("\n\n".join(sections) + "\n", encoding="utf-8")
    process_group.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
