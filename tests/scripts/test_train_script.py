"""Specification of `python -m examples.train`, the training application: CLI, outputs, resume,
accumulation, DDP, AMP.

Runs are real but tiny (digits, one or two epochs; ResNet-50 on a few 32x32 synthetic images).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import import_torchvision
from torch import nn

from examples import train
from examples.training.config import ModelConfig, ScheduleConfig, load_experiment
from examples.training.models import build_network
from examples.training.optimizers import LRFactor, build_optimizer
from kfac_optim import UpdateConfig

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "configs" / "digits.yaml"
TIMINGS = {"time_s", "epoch_s", "step_s", "images_per_s"}


def module_env() -> dict[str, str]:
    """The environment for `python -m examples...` in a subprocess: the repository root importable."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def records(out_dir: Path, run: str) -> list[dict]:
    lines = (out_dir / run / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def without_timings(recs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in recs]


def run_main(*args: str) -> int:
    return train.main([*map(str, args)])


# ---- command line and config ---------------------------------------------------------------


def test_help_lists_the_flags_and_every_config_key() -> None:
    result = subprocess.run([sys.executable, "-m", "examples.train", "--help"], capture_output=True, text=True,
                            timeout=30, cwd=ROOT, env=module_env())
    assert result.returncode == 0
    for text in ("--config", "--runs", "--resume", "--set", "--amp", "--accum-steps", "optim.lr", "train.target"):
        assert text in result.stdout


def test_no_arguments_means_the_digits_config_with_sgd_and_kfac_runs() -> None:
    args = train.build_parser().parse_args([])
    assert args.config == DIGITS
    assert [run.name for run in load_experiment(args.config).runs] == ["sgd", "kfac"]


def test_every_shipped_config_resolves() -> None:
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert load_experiment(path).runs, path


def test_overrides_reach_every_run_or_the_named_one() -> None:
    both = load_experiment(DIGITS, ["optim.lr=0.5"])
    assert [run.optim.lr for run in both.runs] == [0.5, 0.5]
    one = load_experiment(DIGITS, ["kfac.optim.lr=0.5"])
    assert [run.optim.lr for run in one.runs] == [load_experiment(DIGITS).runs[0].optim.lr, 0.5]


def test_a_kfac_update_section_becomes_kfacs_update_config() -> None:
    """``optim.kfac.update: {trust_region: ...}`` (how the shipped configs name the trust region their
    ``kl_clip`` was tuned under) reaches ``KFAC(update=UpdateConfig(...))``."""
    (kfac_run,) = [run for run in load_experiment(DIGITS).runs if run.name == "kfac"]
    model = build_network(kfac_run.model, (1, 8, 8), 10)
    optimizer = build_optimizer(kfac_run.optim, model, steps_per_epoch=10)
    assert optimizer.options.update == UpdateConfig(trust_region="lr_squared")
    assert optimizer.options.kl_clip == kfac_run.optim.kfac["kl_clip"]


def test_an_unknown_key_is_a_usage_error_that_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run_main("--set", "optim.lrr=0.5")
    assert exit_info.value.code == 2
    assert "optim.lrr" in capsys.readouterr().err


def test_missing_cifar10_folder_is_an_error_that_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = run_main("--config", ROOT / "configs" / "cifar10_resnet32.yaml", "--runs", "sgd",
                      "--set", f"data.root={tmp_path}", "--out-dir", tmp_path / "out")
    assert status == 2
    assert str(tmp_path / "cifar-10-batches-py") in capsys.readouterr().err


def test_apex_modes_fail_clearly_when_apex_cannot_be_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "apex", None)  # makes `import apex` raise ImportError
    status = run_main("--runs", "sgd", "--amp", "apex-O1", "--out-dir", tmp_path)
    assert status == 2
    assert "apex" in capsys.readouterr().err.lower()
    assert not (tmp_path / "sgd").exists()  # refused before any training


def test_lr_schedule_warms_up_linearly_then_steps_or_follows_a_cosine() -> None:
    step = LRFactor(ScheduleConfig(kind="step", warmup_epochs=1, milestones=[2, 3], gamma=0.1), 10, 4)
    assert [step(s) for s in (0, 4, 9, 10, 19, 20, 30)] == pytest.approx([0.1, 0.5, 1.0, 1.0, 1.0, 0.1, 0.01])
    cosine = LRFactor(ScheduleConfig(kind="cosine", warmup_epochs=1), 10, 3)
    assert [cosine(s) for s in (10, 20, 30)] == pytest.approx([1.0, 0.5, 0.0])


# ---- training runs -------------------------------------------------------------------------


def test_one_epoch_sgd_run_writes_json_lines_a_plot_and_a_summary(tmp_path: Path) -> None:
    assert run_main("--runs", "sgd", "--epochs", 1, "--out-dir", tmp_path) == 0
    (record,) = records(tmp_path, "sgd")
    batch = load_experiment(DIGITS).runs[0].train.batch_size
    assert record["epoch"] == 1 and record["step"] == 1437 // batch
    assert {"train_loss", "test_loss", "test_acc", "time_s", "images_per_s", "lr"} <= set(record)
    assert record["test_acc"] > 0.5  # one epoch of SGD learns the digits well beyond chance
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| sgd " in (tmp_path / "summary.md").read_text()


def test_resume_continues_exactly_where_the_checkpoint_stopped(tmp_path: Path) -> None:
    assert run_main("--runs", "sgd", "--epochs", 2, "--out-dir", tmp_path / "straight") == 0
    assert run_main("--runs", "sgd", "--epochs", 1, "--out-dir", tmp_path / "resumed") == 0
    assert run_main("--runs", "sgd", "--epochs", 2, "--resume", "--out-dir", tmp_path / "resumed") == 0
    assert (without_timings(records(tmp_path / "resumed", "sgd"))
            == without_timings(records(tmp_path / "straight", "sgd")))


def test_resume_refuses_a_checkpoint_of_a_different_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_main("--runs", "sgd", "--epochs", 1, "--out-dir", tmp_path) == 0
    status = run_main("--runs", "sgd", "--epochs", 2, "--resume", "--set", "optim.lr=0.3", "--out-dir", tmp_path)
    assert status == 2
    assert "optim.lr" in capsys.readouterr().err


def test_gradient_accumulation_matches_one_large_batch(tmp_path: Path) -> None:
    assert run_main("--runs", "sgd", "--epochs", 1, "--out-dir", tmp_path / "one") == 0
    assert run_main("--runs", "sgd", "--epochs", 1, "--accum-steps", 4, "--out-dir", tmp_path / "four") == 0
    (one,), (four,) = records(tmp_path / "one", "sgd"), records(tmp_path / "four", "sgd")
    assert four["step"] == one["step"]
    for key in ("train_loss", "test_loss"):
        assert four[key] == pytest.approx(one[key], rel=1e-4)


def _resnet50_smoke(tmp_path: Path, run: str, *extra: str) -> dict:
    # torchvision's ResNet-50: skipped where torchvision is unusable (tests/project/test_install.py)
    import_torchvision()
    status = run_main(
        "--config", ROOT / "configs" / "imagenet_resnet50.yaml", "--runs", run, "--amp", "bf16", "--epochs", 1,
        "--batch-size", 2, "--out-dir", tmp_path, "--set", "data.name=synthetic", "--set", "data.image_size=32",
        "--set", "data.train_size=6", "--set", "data.test_size=2", "--set", "train.eval_batch_size=2",
        "--set", "optim.lr=0.001", *extra,
    )
    assert status == 0
    (record,) = records(tmp_path, run)
    assert record["step"] == 3 and math.isfinite(record["train_loss"])
    return record


def test_synthetic_imagenet_resnet50_bf16_smoke_run(tmp_path: Path) -> None:
    _resnet50_smoke(tmp_path, "sgd")


def test_one_epoch_kfac_run_writes_json_lines(tmp_path: Path) -> None:
    assert run_main("--runs", "kfac", "--epochs", 1, "--out-dir", tmp_path) == 0
    (record,) = records(tmp_path, "kfac")
    assert record["test_acc"] > 0.5


@pytest.mark.parametrize("config", ["digits.yaml", "digits_autoencoder.yaml"])
def test_sampled_fisher_runs_draw_their_own_targets_and_learn(tmp_path: Path, config: str) -> None:
    metric = {"digits.yaml": "test_acc", "digits_autoencoder.yaml": "train_mse"}[config]
    histories = {}
    for fisher in ("empirical", "sampled"):
        out_dir = tmp_path / fisher
        assert run_main("--config", ROOT / "configs" / config, "--runs", "kfac", "--epochs", 8, "--set",
                        "train.time_budget_s=600", "--set", f"kfac.optim.kfac.fisher={fisher}",
                        "--out-dir", out_dir) == 0
        histories[fisher] = [record[metric] for record in records(out_dir, "kfac")]
    sampled = histories["sampled"]
    assert sampled != histories["empirical"]  # the sampled pass, not the training loss, fed the factors
    assert all(math.isfinite(value) for value in sampled)
    assert sampled[-1] > 0.5 if metric == "test_acc" else sampled[-1] < sampled[0]


def test_gap_cnn_maps_digits_to_logits_with_conv_and_linear_layers_only() -> None:
    model = build_network(ModelConfig(name="digits_gapcnn"), (1, 8, 8), 10)
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    with_params = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    assert [type(m) for m in with_params] == [nn.Conv2d] * 3 + [nn.Linear]  # every one a K-FAC layer


def test_gap_cnn_trains_one_kfac_epoch(tmp_path: Path) -> None:
    assert run_main("--runs", "kfac", "--epochs", 1, "--set", "model.name=digits_gapcnn", "--out-dir", tmp_path) == 0
    (record,) = records(tmp_path, "kfac")
    assert math.isfinite(record["train_loss"]) and record["test_acc"] > 0.2


def test_synthetic_imagenet_resnet50_bf16_kfac_smoke_run(tmp_path: Path) -> None:
    # Only the first stage and the stem are preconditioned: the eigendecompositions of the
    # deeper layers (up to 4608x4608) would dominate a smoke test on 2 CPU cores.
    _resnet50_smoke(tmp_path, "kfac", "--set", "kfac.optim.kfac.damping=0.001",
                    "--set", r"kfac.optim.kfac.skip_layers=['layer[234]\..*', fc]")


@pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None, reason="torchrun unavailable")
def test_two_rank_gloo_run_matches_one_process_on_the_same_global_batches(tmp_path: Path) -> None:
    """torchrun with 2 CPU ranks: DDP over gloo; each rank takes half of every global batch."""
    runs = ["sgd", "kfac"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
               "examples.train", "--runs", *runs, "--epochs", "1", "--out-dir", str(tmp_path / "ddp")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=module_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert run_main("--runs", "sgd", "--epochs", 1, "--out-dir", tmp_path / "single") == 0
    (ddp,), (single,) = records(tmp_path / "ddp", "sgd"), records(tmp_path / "single", "sgd")
    for key in ("train_loss", "test_loss"):
        assert ddp[key] == pytest.approx(single[key], rel=1e-4)
    for run in runs:
        assert len(records(tmp_path / "ddp", run)) == 1  # rank 0 alone writes
