"""The peer benchmark (`python -m benchmarks.peers`): a --quick smoke run and its arithmetic.

Timings and metrics are not asserted (they belong to the benchmark); what is asserted is the
protocol's structure (grid, seeds, every run's history in the JSON, one table row per optimizer,
the plot) and the definitions: interpolated time to a target, metric at a time, the lr grid,
which parameters Muon gets.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.peers import analysis, cli, optimizers
from benchmarks.peers.tasks import TASKS, CharGPT


def test_quick_run_writes_every_history_a_table_row_per_optimizer_and_a_plot(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--quick", "--tasks", "mlp", "--optimizers", "adamw", "kfac", "--jobs", "1",
                     "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "mlp.json").read_text())
    for name in ("adamw", "kfac"):
        runs = saved["runs"][name]
        assert [r["lr"] for r in runs["grid"]] == optimizers.lr_grid(name, 1) == [optimizers.CENTRES[name]]
        assert len(runs["seeds"]) == 1 and runs["seeds"][0]["seed"] == 0
        history = runs["seeds"][0]["history"]
        assert history[0]["time_s"] == 0 and len(history) >= 2
        assert all(a["time_s"] < b["time_s"] for a, b in zip(history, history[1:]))
        assert all(0.0 <= row["test"] <= 1.0 and 0.0 <= row["val"] <= 1.0 for row in history)
    assert saved["settings"]["kfac_settings"] == optimizers.KFAC_SETTINGS
    assert (tmp_path / "mlp.png").stat().st_size > 0
    table = (tmp_path / "peers.md").read_text()
    assert table.count("\n| adamw |") == 1 and table.count("\n| kfac |") == 1
    assert "| adamw |" in capsys.readouterr().out


def test_time_to_a_target_and_the_metric_at_a_time_interpolate_between_evaluations() -> None:
    history = [{"time_s": 0.0, "test": 0.5}, {"time_s": 2.0, "test": 0.7}, {"time_s": 4.0, "test": 0.9}]
    assert analysis.time_to(history, 0.8, higher_is_better=True) == pytest.approx(3.0)
    assert analysis.time_to(history, 0.5, higher_is_better=True) == 0.0
    assert math.isinf(analysis.time_to(history, 0.95, higher_is_better=True))
    assert analysis.time_to(history, 0.6, higher_is_better=False) == 0.0
    assert analysis.metric_at(history, 1.0) == pytest.approx(0.6)
    assert analysis.metric_at(history, 9.0) == pytest.approx(0.9)


def test_lr_grids_share_one_shape_around_each_centre() -> None:
    for name, centre in optimizers.CENTRES.items():
        grid = optimizers.lr_grid(name, 4)
        assert grid[2] == centre and len(grid) == 4
        ratios = [b / a for a, b in zip(grid, grid[1:])]
        assert all(r == pytest.approx(10 ** 0.5, rel=0.01) for r in ratios)


def test_muon_gets_the_hidden_matrices_and_adamw_the_embeddings_tied_head_norms_and_biases() -> None:
    model = CharGPT(width=16, layers=2, heads=2)
    hidden = {id(p) for p in optimizers.hidden_matrices(model, TASKS["gpt"].heads)}
    expected = {id(getattr(block, layer).weight) for block in model.blocks for layer in ("qkv", "proj", "fc", "out")}
    assert hidden == expected
    assert id(model.head.weight) == id(model.token.weight) not in hidden


def test_kfac_variants_run_on_request_only_and_the_adaptive_one_steps_with_a_closure(tmp_path: Path) -> None:
    assert set(optimizers.KFAC_VARIANTS).isdisjoint(cli.parse([]).optimizers)
    assert optimizers.needs_closure("kfac_eigen_lm") and not optimizers.needs_closure("kfac_eigen")
    assert not any(optimizers.needs_closure(name) for name in optimizers.OPTIMIZERS)
    assert cli.main(["--quick", "--tasks", "mlp", "--optimizers", "kfac_eigen_lm", "--jobs", "1",
                     "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "mlp.json").read_text())
    run = saved["runs"]["kfac_eigen_lm"]["seeds"][0]
    assert run["steps"] > 5 and not run["diverged"] and run["warnings"] == []
    assert "AdaptiveDamping(initial=0.1, every=5" in saved["settings"]["kfac_variants"]["kfac_eigen_lm"]["damping"]
