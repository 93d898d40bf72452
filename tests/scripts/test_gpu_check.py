"""``python -m benchmarks.gpu_check``: without a GPU a dry run that says what it would run and
exits 0; its pieces that need no GPU (reading pytest's summary, timing steps) on the CPU.
(``--device cpu --quick`` runs every phase end to end on the CPU; too slow for the suite.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import gpu_check
from kfac_optim import KFAC


def test_gpu_check_dry_run_says_what_it_would_run_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "dry run" in printed and "pytest -m cuda" in printed
    assert all(f"--phase {name}" in printed for name in ("resnet50", "gpt", "costs"))
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["dry_run"] is True and saved["phases"] == list(gpu_check.PHASES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: the check would run")
def test_gpu_check_without_cuda_is_a_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "no CUDA device" in printed and "dry run: torch.cuda.is_available() is False" in printed


def test_pytest_counts_reads_pytests_last_line() -> None:
    summary = "===== 1 failed, 12 passed, 3 skipped, 2 errors in 41.20s ====="
    assert gpu_check.pytest_counts(summary) == {"failed": 1, "passed": 12, "skipped": 3, "error": 2}
    assert gpu_check.pytest_counts("19 skipped in 6.26s") == {"skipped": 19}


def test_measure_runs_times_each_optimizer_against_the_first() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    batch = (torch.randn(8, 6), torch.randint(0, 3, (8,)))
    optimizers = {"sgd": gpu_check.sgd, "kfac": lambda m: KFAC(m, lr=0.1)}  # automatic intervals
    result = gpu_check.measure_runs(build, batch, F.cross_entropy, optimizers, torch.device("cpu"), warmup=1, steps=3,
                                    deadline=float("inf"))
    assert result["status"] == "measured" and list(result["runs"]) == ["sgd", "kfac"]
    assert result["runs"]["sgd"]["median_ratio"] == result["runs"]["sgd"]["mean_ratio"] == 1.0
    for timing in result["runs"].values():
        assert timing["steps"] == 3 and len(timing["times_ms"]) == 3 and timing["first_ms"] > 0
    assert "intervals" not in result["runs"]["sgd"] and len(result["runs"]["kfac"]["intervals"]) == 2
