"""The recipes of examples/recipes and the main job (benchmarks.digits) run on tiny settings.

Each recipe checks what it demonstrates and returns a non-zero status when it does not hold; the
tests run them as a user would (`main(argv)`, or `torchrun -m` for DDP) and read what they print.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import digits
from examples import train
from examples.recipes import accumulation, amp, imagenet, resume, transformer
from examples.training.config import Experiment, load_experiment
from examples.training.report import write_records

ROOT = Path(__file__).resolve().parents[2]


def test_bf16_recipe_trains_close_to_fp32(capsys: pytest.CaptureFixture[str]) -> None:
    assert amp.main(["--dtype", "bf16", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "bf16" in out and "(decreased: True)" in out and "bf16 within 2% of it: True" in out


def test_fp16_recipe_trains_with_a_grad_scaler(capsys: pytest.CaptureFixture[str]) -> None:
    assert amp.main(["--dtype", "fp16", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "fp16" in out and "(decreased: True)" in out and "fp16 within 2% of it: True" in out


@pytest.mark.parametrize("mixed_run", [(2.3, float("nan")), (2.3, 2.4), (2.3, 1.0)],
                         ids=["non-finite", "loss went up", "far from fp32"])
def test_amp_recipe_exits_nonzero_when_the_mixed_run_fails(
    mixed_run: tuple[float, float], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The recipe's own check can fail: a mixed-precision run that diverges, does not learn or
    drifts from the fp32 run gives exit status 1 (the fp32 run ends at 2.2 here)."""
    monkeypatch.setattr(amp, "train", lambda dtype, device, steps: (2.3, 2.2) if dtype == "fp32" else mixed_run)
    assert amp.main(["--dtype", "bf16", "--steps", "4"]) == 1


def test_accumulation_recipe_matches_one_large_batch(capsys: pytest.CaptureFixture[str]) -> None:
    assert accumulation.main(["--accum-steps", "4", "--steps", "3"]) == 0
    assert "max parameter difference" in capsys.readouterr().out


def test_resume_recipe_continues_bit_identically(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert resume.main(["--steps", "6", "--checkpoint", str(tmp_path / "checkpoint.pt")]) == 0
    assert "identical to the straight run: True" in capsys.readouterr().out
    assert (tmp_path / "checkpoint.pt").stat().st_size > 0


def test_transformer_recipe_trains_and_kfac_preconditions_its_weight_matrices(
    capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = ["--steps", "8", "--batch-size", "8", "--context", "16", "--width", "32", "--layers", "1", "--heads", "2"]
    assert transformer.main(tiny) == 0
    out = capsys.readouterr().out
    assert out.startswith("KFAC (inverse): 7 blocks precondition")  # describe(): embeddings, attention, MLP, head
    assert "(decreased: True)" in out and "(>= 95%: True)" in out


def torchrun(module: str, *args: str, directory: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node=2 -m module args`` in ``directory``: 2 gloo ranks, one thread each."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", module, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=directory, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


needs_torchrun = pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None,
                                    reason="torchrun unavailable")


@needs_torchrun
def test_ddp_recipe_under_torchrun_keeps_two_gloo_ranks_bit_identical(tmp_path: Path) -> None:
    result = torchrun("examples.recipes.ddp", "--steps", "4", "--batch-size", "16", directory=tmp_path, timeout_s=120)
    assert "2 ranks, parameters bit-identical on every rank: True" in result.stdout


@needs_torchrun
def test_fsdp_recipe_under_torchrun_resumes_from_its_dcp_checkpoint_exactly(tmp_path: Path) -> None:
    result = torchrun("examples.recipes.fsdp", "--steps", "12", "--batch-size", "16", directory=tmp_path, timeout_s=180)
    assert "2 ranks, resumed from the DCP checkpoint after 6 steps" in result.stdout
    assert "max parameter difference to the straight run 0.00e+00: True" in result.stdout


def test_imagenet_shaped_recipe_checkpoints_on_rank_0_and_resumes_exactly_on_two_spawned_ranks(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """pytorch/examples' ImageNet script with KFAC: 2 gloo ranks by ``torch.multiprocessing.spawn``,
    bf16 autocast, rank 0 alone saving ``optimizer.state_dict()`` after every epoch. 4 steps an
    epoch, decompositions every 3 steps: epoch 1 ends right after a decomposition step (its
    checkpoint resumes bit-identically), epochs 2 and 3 do not (their checkpoints must not block).
    The run resumed from epoch 1 must end with the uninterrupted run's model, and the ranks agree.
    ``--dist-timeout`` bounds every collective: a rank that waits for the others fails the test."""
    common = ["--world-size", "2", "--epochs", "3", "--batch-size", "16", "--train-size", "64", "--val-size", "32",
              "--factor-update-steps", "1", "--decomposition-update-steps", "3", "--amp", "bf16",
              "--dist-timeout", "30"]
    assert imagenet.main([*common, "--keep-checkpoints", "--checkpoint-dir", str(tmp_path / "straight"),
                          "--dist-url", f"file://{tmp_path / 'rendezvous-straight'}"]) == 0
    assert imagenet.main([*common, "--resume", str(tmp_path / "straight" / "checkpoint-epoch1.pth.tar"),
                          "--checkpoint-dir", str(tmp_path / "resumed"),
                          "--dist-url", f"file://{tmp_path / 'rendezvous-resumed'}"]) == 0
    out = capfd.readouterr().out
    assert out.count("2 ranks, parameters bit-identical on every rank: True") == 2
    assert "=> loaded checkpoint" in out and "epoch 3/3" in out
    straight, resumed = (torch.load(tmp_path / run / "checkpoint.pth.tar", weights_only=True)
                         for run in ("straight", "resumed"))
    assert straight["epoch"] == resumed["epoch"] == 3
    assert straight["state_dict"].keys() == resumed["state_dict"].keys()
    assert all(torch.equal(straight["state_dict"][k], resumed["state_dict"][k]) for k in straight["state_dict"])


RECIPES_WITH_OPTIONS = sorted(path.stem for path in (ROOT / "examples" / "recipes").glob("*.py")
                              if "ArgumentParser(" in path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", RECIPES_WITH_OPTIONS)
def test_recipe_help_shows_every_options_default(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(f"examples.recipes.{name}").main(["--help"])
    assert exited.value.code == 0
    options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    entries = [" ".join(entry.split()) for entry in re.split(r"\n  (?=-)", options)]
    without = [entry.split()[0] for entry in entries if not entry.startswith("-h") and "(default: " not in entry]
    assert len(entries) > 1 and without == []


def test_imagenet_recipe_writes_its_checkpoints_into_an_ignored_folder() -> None:
    folder = imagenet.parse_args([]).checkpoint_dir
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").split()
    assert not folder.is_absolute() and folder.parts[:1] and f"{folder.parts[0]}/" in ignored, folder


def main_job_verdict(out_dir: Path, row: str) -> str:
    """What a summary row of the main job must say, recomputed from its two runs' metrics.jsonl:
    the goal is the config's target, or the other run's final value (``goal`` cell "<run>'s final
    <metric> <value>"); K-FAC wins when it reaches the goal in less training time."""
    task, versus, goal = row.strip("| ").split(" | ")[:3]
    histories = {run: [json.loads(line) for line in (out_dir / task / run / "metrics.jsonl").read_text().splitlines()]
                 for run in ("kfac", versus)}
    metric = goal.split()[-2]
    lower_is_better = not metric.endswith("_acc")  # accuracies improve upward, losses and errors downward
    value = float(goal.split()[-1]) if goal.startswith(metric) else histories[versus][-1][metric]

    def time_to_goal(records: list[dict]) -> float | None:
        return next((r["time_s"] for r in records
                     if (r[metric] <= value if lower_is_better else r[metric] >= value)), None)

    ours, theirs = time_to_goal(histories["kfac"]), time_to_goal(histories[versus])
    if ours is None:
        return "K-FAC loses (never reaches it)"
    if theirs is None:
        return "K-FAC wins (the other never reaches it)"
    return "K-FAC wins" if ours < theirs else "K-FAC loses"


def test_main_job_trains_each_task_as_examples_train_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m benchmarks.digits` and `python -m examples.train --config configs/<task>.yaml` train the
    same experiment (the same clock above all), so the times they print compare."""
    trained: dict[str, Experiment] = {}

    def record_instead_of_training(argv: list[str]) -> int:
        args = train.build_parser().parse_args(argv)
        experiment = load_experiment(args.config, train.overrides_from(args))
        trained[experiment.name] = experiment
        for run in experiment.runs:  # one epoch's record per run, for the summary benchmarks.digits writes
            write_records(args.out_dir / run.name / "metrics.jsonl",
                          [{"epoch": 1, "step": 1, "time_s": 1.0, run.train.metric: 0.5}])
        return 0

    monkeypatch.setattr(digits.train, "main", record_instead_of_training)
    assert digits.main(["--out-dir", str(tmp_path)]) == 0
    as_examples_train = [load_experiment(config) for config in digits.TASKS]
    assert trained == {experiment.name: experiment for experiment in as_examples_train}


def test_main_job_runs_both_tasks_and_says_where_kfac_wins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = digits.main(["--out-dir", str(tmp_path), "--set", "train.epochs=1", "--set", "train.time_budget_s=1"])
    assert status == 0
    out = capsys.readouterr().out
    assert "## Where K-FAC wins and where it does not" in out
    summary = (tmp_path / "summary.md").read_text()
    rows = [line for line in summary.splitlines() if line.startswith("| digits")]
    assert [row.split(" | ")[1] for row in rows] == ["sgd", "sgd", "adamw"]  # digits; autoencoder vs SGD, AdamW
    for row in rows:
        assert row.split(" | ")[-1].rstrip(" |") == main_job_verdict(tmp_path, row), row
    for task in ("digits", "digits_autoencoder"):
        assert (tmp_path / task / "plot.png").stat().st_size > 0
