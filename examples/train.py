"""Train and compare the runs of a YAML config; the project's main job.

    python -m examples.train                                   # configs/digits.yaml: SGD vs K-FAC
    python -m examples.train --config configs/digits_autoencoder.yaml
    python -m examples.train --runs sgd --epochs 5 --set optim.lr=0.05
    torchrun --standalone --nproc_per_node=2 -m examples.train --config configs/digits.yaml

Run from the repository root (``examples`` is a folder beside the library, not an installed package).

Each run trains from the same seed. Outputs go to --out-dir (default runs/<config name>/):
<run>/metrics.jsonl (one JSON record per epoch), <run>/checkpoint.pt, <run>/config.yaml,
plot.png (the metric vs training time and vs epoch) and summary.md (the table printed at the end).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from examples.training.config import AMP_MODES, DEVICES, Experiment, SetupError, describe_keys, load_experiment

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "digits.yaml"
# --flag -> the train.* key it sets in every run
TRAIN_FLAGS = {"epochs": int, "batch_size": int, "accum_steps": int, "amp": str, "device": str, "seed": int,
               "threads": int}


def build_parser() -> argparse.ArgumentParser:
    """The command line; `--help` also lists every config key with its default."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.train",
        description=__doc__.split("\n\n")[0] + " Trains every run of the config (or those of --runs), "
        "prints a comparison table and writes per-epoch JSON lines, a plot and checkpoints.",
        epilog="overrides (--set KEY=VALUE, applied after the flags above; VALUE is YAML):\n"
        "  section.key=VALUE        every run, e.g. --set optim.lr=0.05 --set schedule.milestones=[10,20]\n"
        "  RUN.section.key=VALUE    one run, e.g. --set kfac.optim.kfac.damping=0.01\n\n"
        "config keys (section.key = default):\n" + describe_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="YAML config (default: configs/digits.yaml)")
    parser.add_argument("--runs", nargs="+", metavar="RUN", help="train only these runs of the config, in this order")
    parser.add_argument("--out-dir", type=Path, help="output folder (default: runs/<config name>)")
    parser.add_argument("--resume", action="store_true",
                        help="continue each run from its checkpoint in the output folder "
                             "(runs without one start fresh)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable; see below)")
    group = parser.add_argument_group("shortcuts for train.* keys (every run)")
    group.add_argument("--epochs", type=int)
    group.add_argument("--batch-size", type=int, help="global batch per optimizer step")
    group.add_argument("--accum-steps", type=int, help="micro-batches per optimizer step (gradient accumulation)")
    group.add_argument("--amp", choices=AMP_MODES, help="mixed precision (apex-* need CUDA and NVIDIA Apex)")
    group.add_argument("--device", choices=DEVICES)
    group.add_argument("--seed", type=int)
    group.add_argument("--threads", type=int, help="torch threads per process")
    return parser


def overrides_from(args: argparse.Namespace) -> list[str]:
    """The shortcut flags as `train.key=value` overrides, followed by the explicit --set ones."""
    flags = [f"train.{key}={getattr(args, key)}" for key in TRAIN_FLAGS if getattr(args, key) is not None]
    return flags + args.overrides


def _check_comparable(experiment: Experiment) -> None:
    first = experiment.runs[0].train
    for run in experiment.runs[1:]:
        if (run.train.metric, run.train.target) != (first.metric, first.target):
            raise ValueError(f"runs {experiment.runs[0].name!r} and {run.name!r} report different metrics or targets; "
                             "the runs of one config are compared on one metric")


def main(argv: list[str] | None = None) -> int:
    """Run the job; returns the exit status (0, or 2 for a usage or setup error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        experiment = load_experiment(args.config, overrides_from(args), args.runs)
        _check_comparable(experiment)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))

    from examples.training import process_group, trainer  # torch is imported only once the arguments are good

    env = process_group.setup(experiment.runs[0].train.device)
    out_dir = args.out_dir or Path("runs") / experiment.name
    try:
        try:
            for run in experiment.runs:
                trainer.preflight(run, env)
            trainers = ((run, trainer.Trainer(run, env, out_dir / run.name)) for run in experiment.runs)
            histories = {run.name: job.run(args.resume) for run, job in trainers}
        except SetupError as err:
            print(f"{parser.prog}: error: {err}", file=sys.stderr)
            return 2
        if env.is_main:
            _report(experiment, histories, out_dir, argv)
    finally:
        process_group.teardown()
    return 0


def _report(experiment: Experiment, histories: dict, out_dir: Path, argv: list[str] | None) -> None:
    """Print the table; write summary.md and plot.png."""
    from examples.training.plotting import plot_runs
    from examples.training.report import format_table, summarize_runs

    train = experiment.runs[0].train
    summaries, goal = summarize_runs(histories, train.metric, train.target, train.higher_is_better)
    table = format_table(summaries, train.metric, goal)
    command = shlex.join(["python", "-m", "examples.train", *(sys.argv[1:] if argv is None else argv)])
    (out_dir / "summary.md").write_text(f"`{command}`\n\n{table}\n", encoding="utf-8")
    plot_runs(histories, train.metric, train.target, train.higher_is_better,
              f"{experiment.name}: {train.metric}", out_dir / "plot.png", train.clock)
    print(table)
    print(f"\nwrote {out_dir}/: plot.png, summary.md, <run>/metrics.jsonl", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
