"""``python -m benchmarks.large_batch``'s arithmetic: the critical batch, the lr grid's extension,
the generated data and the projection's byte counts, and its command line's resumption (no training: a
run takes too long for the suite; the command line's runs are fakes)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks.comm_bytes import comm_bytes
from benchmarks.large_batch import cli, projection, study
from benchmarks.large_batch.data import LENGTH, generate
from benchmarks.peers import optimizers


@pytest.mark.parametrize("steps, critical", [
    ({128: 400, 512: 100, 2048: 25}, 2048),     # 2x per doubling all the way
    ({128: 400, 512: 100, 2048: 60}, 512),      # 1.29x per doubling from 512
    ({128: 400, 512: 300, 2048: 25}, 128),      # 1.15x per doubling at once
    ({128: math.inf, 512: 100, 2048: 40}, 2048),  # never at 128: the sweep starts where it reaches
    ({128: math.inf, 512: math.inf}, None),
])
def test_the_critical_batch_is_the_last_batch_while_doubling_still_cuts_steps_by_one_and_a_half(
        steps: dict[int, float], critical: int | None) -> None:
    assert study.critical_batch(steps) == critical


def fake_large_batch_run(spec: study.RunSpec, best_lr: float) -> study.Run:
    """A run of ``spec`` whose steps to the target grow with the distance of its lr from ``best_lr``
    (in grid points), reaching the target (validation and test alike) at once."""
    steps = 10 + round(abs(math.log10(spec.lr / best_lr)) * 20)
    history = [{"step": 0, "time_s": 0.0, "val": 0.0, "test": 0.0},
               {"step": steps, "time_s": steps * 0.01, "val": 1.0, "test": 1.0}]
    return {**spec.__dict__, "history": history, "diverged": False, "steps": steps}


def test_the_grid_is_extended_while_the_choice_sits_at_an_edge_for_every_optimizer_alike() -> None:
    best = {"sgd": 10.0, "adamw": 3e-3, "muon": 1e-4}  # 2.5 points above SGD's centre, AdamW's centre, 2 below Muon's
    rounds: list[list[study.RunSpec]] = []

    def run_all(specs: list[study.RunSpec]) -> list[study.Run]:
        rounds.append(specs)
        return [fake_large_batch_run(spec, best[spec.optimizer]) for spec in specs]

    grid_runs, chosen = study.search(run_all, "cnn", list(best), [128, 2048], 3, 100)
    assert all(spec.seed == 0 for specs in rounds for spec in specs) and len(rounds) == 3
    assert rounds[0] == [study.RunSpec("cnn", n, b, lr, 0, 100) for b in (128, 2048) for n in best
                         for lr in optimizers.lr_grid(n, 3)]
    for batch in (128, 2048):
        tried = {n: sorted(r["lr"] for r in grid_runs if (r["optimizer"], r["batch"]) == (n, batch)) for n in best}
        # SGD: centre 0.3, grid 0.0949-0.949, extended twice above (3.0, 9.49) and left at the edge
        assert tried["sgd"] == [0.0949, 0.3, 0.949, 3.0, 9.49] and chosen[("sgd", batch)]["lr"] == 9.49
        assert tried["adamw"] == optimizers.lr_grid("adamw", 3) and chosen[("adamw", batch)]["lr"] == 3e-3
        # Muon: centre 1e-2, grid 3.16e-3-3.16e-2, extended twice below; its best (1e-4) is beyond the bound
        assert tried["muon"] == [0.000316, 0.001, 0.00316, 0.01, 0.0316] and chosen[("muon", batch)]["lr"] == 0.000316
    assert len(grid_runs) == len({(r["optimizer"], r["batch"], r["lr"]) for r in grid_runs})  # no rate run twice


large_batch_projection = functools.cache(projection.project)
"""The projection, computed once for the command-line tests (a second each; nothing they check)."""


def large_batch_counting_train(monkeypatch: pytest.MonkeyPatch, fail_on: str | None = None) -> list[str]:
    """Replace the study's run by :func:`fake_large_batch_run` (best lr: the family's centre) and the
    projection by its cached copy; the optimizers it ran, in order (``fail_on``: interrupted at that
    optimizer's first run)."""
    calls: list[str] = []

    def fake(spec: study.RunSpec) -> study.Run:
        if spec.optimizer == fail_on:
            raise KeyboardInterrupt
        calls.append(spec.optimizer)
        return {**fake_large_batch_run(spec, optimizers.CENTRES[spec.optimizer]), "step_s": 0.01}

    monkeypatch.setattr(study, "train", fake)
    monkeypatch.setattr(projection, "project", large_batch_projection)
    return calls


def test_an_interrupted_run_keeps_its_finished_searches_and_a_rerun_skips_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--tasks", "cnn", "--batches", "128", "--grid-points", "1", "--seeds", "2", "--max-steps", "30",
            "--jobs", "1", "--out", str(tmp_path), "--optimizers"]
    calls = large_batch_counting_train(monkeypatch, fail_on="adamw")
    with pytest.raises(KeyboardInterrupt):
        cli.main([*args, "sgd", "adamw"])
    assert calls == ["sgd"] * 2  # one lr, then seed 1
    saved = json.loads((tmp_path / "large_batch.json").read_text())
    assert set(saved["searches"]["cnn"]) == {"sgd 128"}
    assert [r["optimizer"] for r in saved["tasks"]["cnn"]["rows"]] == ["sgd"]

    calls = large_batch_counting_train(monkeypatch)
    assert cli.main([*args, "sgd", "adamw"]) == 0
    assert calls == ["adamw"] * 2  # SGD's search is not run again
    again = json.loads((tmp_path / "large_batch.json").read_text())
    assert again["searches"]["cnn"]["sgd 128"] == saved["searches"]["cnn"]["sgd 128"]
    assert [r["optimizer"] for r in again["tasks"]["cnn"]["rows"]] == ["sgd", "adamw"]
    assert all(len(r["steps"]) == 2 for r in again["tasks"]["cnn"]["rows"])
    assert "| 128 | AdamW |" in (tmp_path / "large_batch.md").read_text()
    with pytest.raises(SystemExit):  # other settings into the same folder
        cli.main([*args, "sgd", "--max-steps", "40"])
    assert "other ['max_steps']" in capsys.readouterr().err


def test_a_run_made_in_pieces_joins_into_one_report_and_a_search_in_both_is_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    large_batch_counting_train(monkeypatch)
    common = ["--tasks", "cnn", "--batches", "128", "--grid-points", "1", "--seeds", "1", "--jobs", "1"]
    cli.main([*common, "--optimizers", "sgd", "--out", str(tmp_path / "a")])
    cli.main([*common, "--optimizers", "adamw", "--out", str(tmp_path / "b")])
    cli.main([*common, "--out", str(tmp_path / "all"), "--merge", str(tmp_path / "a"), str(tmp_path / "b")])
    joined = json.loads((tmp_path / "all" / "large_batch.json").read_text())
    assert [r["optimizer"] for r in joined["tasks"]["cnn"]["rows"]] == ["sgd", "adamw"]
    with pytest.raises(SystemExit):
        cli.main([*common, "--out", str(tmp_path / "twice"), "--merge", str(tmp_path / "a"), str(tmp_path / "a")])


def test_the_data_are_the_same_for_the_same_seed_and_every_class_appears() -> None:
    x, y = generate(500, seed=3)
    again, labels = generate(500, seed=3)
    assert x.shape == (500, 1, LENGTH) and torch.equal(x, again) and torch.equal(y, labels)
    assert set(y.tolist()) == set(range(10))
    assert not torch.equal(x, generate(500, seed=4)[0])


def test_the_projection_uses_comm_bytes_and_kfac_adds_to_sgds_iteration() -> None:
    layers = projection.resnet50_layers()
    assert len(layers) == 54  # 53 convolutions and the head
    result = projection.project()
    dims = {str(i): (layer["in"], layer["out"]) for i, layer in enumerate(layers)}
    assert result["bytes"] == comm_bytes(dims)
    assert 7.5 < result["forward_gflops_per_sample"] < 8.5  # ResNet-50's ~4.1 GMACs at 224 px
    for row in result["rows"]:
        assert row["kfac_s"] > row["sgd_s"] > row["compute_s"] > 0
        assert row["break_even_steps_ratio"] == pytest.approx(row["sgd_s"] / row["kfac_s"])
