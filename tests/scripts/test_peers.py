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
import torch

from benchmarks.peers import analysis, cli, optimizers, transformer_goal
from benchmarks.peers.protocol import Runner, RunSpec, train, tune_and_seed
from benchmarks.peers.tasks import TASKS, CharGPT, NanoGPT


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


def test_nanogpt_is_causal_ties_its_head_and_is_initialised_as_nanogpt() -> None:
    torch.manual_seed(0)
    layers, width = 2, 32
    model = NanoGPT(width=width, layers=layers, heads=2)
    tokens = torch.randint(0, 256, (2, 10))
    logits = model(tokens)
    assert logits.shape == (2, 10, 256)
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 256
    assert torch.equal(model(changed)[:, :6], logits[:, :6]) and not torch.equal(model(changed)[:, 6:], logits[:, 6:])
    assert model.head.weight is model.token.weight
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(torch.count_nonzero(m.bias) == 0 for m in linears if m.bias is not None)
    projections = {id(b.proj.weight) for b in model.blocks} | {id(b.out.weight) for b in model.blocks}
    # 1024 and more draws each: the sample std is within 10% of nanoGPT's std
    for weight in [m.weight for m in linears] + [model.position.weight]:
        expected = 0.02 / (2 * layers) ** 0.5 if id(weight) in projections else 0.02
        assert weight.std().item() == pytest.approx(expected, rel=0.1)


def test_adamw_and_muons_adamw_take_the_tasks_betas() -> None:
    model = NanoGPT(width=16, layers=1, heads=2)
    for task, betas in (("nanogpt", (0.9, 0.95)), ("gpt", (0.9, 0.999))):
        assert optimizers.build("adamw", model, 1e-3, TASKS[task]).defaults["betas"] == betas
        muon_pair = optimizers.build("muon", model, 1e-3, TASKS[task])
        assert muon_pair.optimizers[1].defaults["betas"] == betas


def peers_search_at_lr(spec: RunSpec) -> dict[str, object]:
    """A stand-in run whose validation loss is the lr's distance in decades from 0.03 (adamw) or from
    its grid's centre (anyone else)."""
    best = optimizers.rate(spec.optimizer, 2 if spec.optimizer == "adamw" else 0)
    loss = abs(math.log10(spec.lr / best))
    return {"optimizer": spec.optimizer, "lr": spec.lr, "seed": spec.seed, "diverged": False,
            "history": [{"val": loss, "test": loss}]}


def test_the_lr_search_grows_a_grid_while_its_best_sits_at_an_edge() -> None:
    runner = Runner(1, lambda run: None, run=peers_search_at_lr)
    results = tune_and_seed(runner, "gpt", ["adamw", "kfac_ema"], points=3, seeds=2, budget_scale=1.0, evals=1)
    # adamw's grid -1..1 grows to 2 (best at the top edge), then to 3, where 2 is inside: it stops
    assert [r["lr"] for r in results["adamw"]["grid"]] == [optimizers.rate("adamw", k) for k in range(-1, 4)]
    assert results["adamw"]["best_lr"] == optimizers.rate("adamw", 2) == 0.03
    assert [r["lr"] for r in results["kfac_ema"]["grid"]] == optimizers.lr_grid("kfac_ema", 3)
    assert [(r["seed"], r["lr"]) for r in results["adamw"]["seeds"]] == [(0, 0.03), (1, 0.03)]


def peers_goal_history(losses: list[float], seconds: float) -> list[dict[str, float]]:
    """Evaluations every ``seconds`` and every 10 steps, at ``losses``."""
    return [{"step": 10 * i, "time_s": seconds * i, "val": v, "test": v} for i, v in enumerate(losses)]


def test_the_transformer_goal_interpolates_time_to_adamws_final_and_steps_to_muons_final() -> None:
    def result(lr: float, *histories: list[dict[str, float]]) -> dict[str, object]:
        seeds = [{"lr": lr, "diverged": False, "history": h, "step_s": h[1]["time_s"] / 10} for h in histories]
        return {"grid": [{"lr": 1e-3}, {"lr": lr}, {"lr": 1e-1}], "best_lr": lr, "seeds": seeds}

    results = {"adamw": result(1e-3, peers_goal_history([4.0, 3.0, 2.0], 1.0)),
               "muon": result(1e-2, peers_goal_history([4.0, 2.5, 2.2, 2.1], 5.0)),
               "kfac_ema": result(1e-2, peers_goal_history([4.0, 2.0, 1.0], 2.0))}
    row, = transformer_goal.measure("gpt", results, "val")
    # AdamW reaches its final 2.0 at 2 s; K-FAC at its first evaluation, 2 s: ratio 1
    assert (row["to_adamw_s"], row["adamw_s"], row["time_ratio"]) == (2.0, 2.0, 1.0)
    assert (row["to_adamw_steps"], row["adamw_steps"]) == (10, 20)
    # Muon's final 2.1 at its 30th step; K-FAC passes 2.1 between 0 (4.0) and 10 (2.0) steps: 1.9 / 2 of 10
    assert row["muon_steps"] == 30 and row["to_muon_steps"] == pytest.approx(9.5)
    assert row["met"] == {"time": False, "steps": True, "lr_inside": True}


def test_a_short_nanogpt_run_trains_and_evaluates_on_the_char_splits() -> None:
    run = train(RunSpec("nanogpt", "adamw", 3e-3, seed=0, budget_s=0.3, evals=1))
    assert run["steps"] >= 1 and not run["diverged"]
    start, end = run["history"][0], run["history"][-1]
    assert start["val"] == pytest.approx(math.log(256), rel=0.05)  # nanoGPT's init: near-uniform logits
    assert end["val"] < start["val"] and math.isfinite(end["test"])
