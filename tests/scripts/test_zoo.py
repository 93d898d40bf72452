"""``python -m benchmarks.zoo`` runs end to end on one model for 2 steps and writes its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.zoo import available
from benchmarks.zoo import run as zoo


@pytest.mark.skipif("gpt2" not in available(), reason="transformers does not import here")
def test_the_zoo_runs_each_optimizer_over_its_grid_and_writes_json_markdown_and_a_plot(tmp_path: Path) -> None:
    payload = zoo.main(["--models", "gpt2", "--optimizers", "sgd", "kfac", "--steps", "2", "--seeds", "1",
                        "--out", str(tmp_path)])
    summary = payload["results"]["gpt2"]
    assert set(summary) == {"sgd", "kfac"}
    for name, s in summary.items():
        assert len(s["grid"]) >= 3 and s["lr"] in s["grid"]
        assert s["grid"][:3] == [zoo.grid_lr(name, k) for k in (-1, 0, 1)] or s["grid"][0] < zoo.grid_lr(name, -1)
        assert s["final"] > 0 and s["equal_time"] > 0 and s["step_s"] > 0
    assert summary["sgd"]["step_ratio"] == 1.0 and summary["sgd"]["coverage"] is None
    assert 0 < summary["kfac"]["coverage"] <= 1
    runs = json.loads((tmp_path / "zoo.json").read_text())["runs"]
    assert {(r["optimizer"], r["lr"]) for r in runs} >= {("sgd", lr) for lr in summary["sgd"]["grid"]}
    assert all(len(r["times"]) == 2 and r["times"][0] <= r["times"][1] for r in runs)
    assert "| gpt2 | decoder |" in (tmp_path / "zoo.md").read_text() and (tmp_path / "zoo.png").exists()


def test_the_budget_loss_is_that_of_the_last_step_done_within_it() -> None:
    run = zoo.Run("sgd", 0.1, 0, times=[1.0, 2.0, 3.0], test=[5.0, 4.0, 3.0], test_start=6.0, validation=3.0,
                  coverage=None)
    assert [zoo.loss_at(run, budget) for budget in (0.5, 1.0, 2.5, 9.0)] == [6.0, 5.0, 4.0, 3.0]
