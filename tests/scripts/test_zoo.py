"""``python -m benchmarks.zoo`` runs end to end on one model for 2 steps and writes its table."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from benchmarks.zoo import ZOO, available, curvature
from benchmarks.zoo import models as zoo_models
from benchmarks.zoo import run as zoo
from benchmarks.zoo.models import CHANNELS, IMAGE, IMAGE_CLASSES


def test_the_zoo_runs_each_optimizer_over_its_grid_and_writes_json_markdown_and_a_plot(tmp_path: Path) -> None:
    if not available(["gpt2"]):  # here, not in a skipif: collecting would import every zoo library
        pytest.skip("transformers does not import here")
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


def zoo_fake_run(name: str, lr: float, seed: int, steps: int, best_lr: float) -> zoo.Run:
    """A run whose validation and test losses grow with the distance of ``lr`` from ``best_lr``."""
    loss = 1.0 + abs(math.log10(lr / best_lr))
    return zoo.Run(name, lr, seed, times=[0.1 * (k + 1) for k in range(steps)], test=[loss] * steps, test_start=3.0,
                   validation=loss, coverage=None)


def test_the_grid_grows_beyond_an_edge_while_the_choice_sits_there_and_stops_after_two_points(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    best = {"sgd": 10.0, "adamw": 3e-3}  # 2 points above SGD's grid (centre 0.1); AdamW's centre
    monkeypatch.setattr(zoo, "train", lambda entry, name, lr, seed, steps, batch: zoo_fake_run(
        name, lr, seed, steps, best[name]))
    payload = zoo.main(["--models", "gpt2", "--optimizers", "sgd", "adamw", "--steps", "2", "--seeds", "1",
                        "--out", str(tmp_path)])
    sgd, adamw = payload["results"]["gpt2"]["sgd"], payload["results"]["gpt2"]["adamw"]
    assert sgd["grid"] == [zoo.grid_lr("sgd", k) for k in range(-1, 4)] and sgd["lr"] == zoo.grid_lr("sgd", 3)
    assert sgd["at_edge"]  # 10 is one point beyond the grid's bound (two extensions)
    assert adamw["grid"] == [zoo.grid_lr("adamw", k) for k in (-1, 0, 1)] and adamw["lr"] == 3e-3
    assert not adamw["at_edge"]


def zoo_counting_train(monkeypatch: pytest.MonkeyPatch, fail_on: str | None = None) -> list[str]:
    """Replace the zoo's ``train`` by a fake run; the names it was called with (``fail_on``: raise for it)."""
    calls: list[str] = []

    def fake(entry: object, name: str, lr: float, seed: int, steps: int, batch: int) -> zoo.Run:
        if name == fail_on:
            raise KeyboardInterrupt
        calls.append(name)
        return zoo_fake_run(name, lr, seed, steps, zoo.CENTRES[name])

    monkeypatch.setattr(zoo, "train", fake)
    return calls


def test_each_finished_search_is_in_the_json_before_the_next_starts(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    zoo_counting_train(monkeypatch, fail_on="kfac")
    with pytest.raises(KeyboardInterrupt):
        zoo.main(["--models", "gpt2", "--optimizers", "sgd", "kfac", "--steps", "2", "--seeds", "1",
                  "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "zoo.json").read_text())
    assert set(saved["results"]["gpt2"]) == {"sgd"} and {r["optimizer"] for r in saved["runs"]} == {"sgd"}


def test_a_rerun_into_the_same_folder_skips_the_searches_it_holds_and_refuses_other_settings(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = zoo_counting_train(monkeypatch)
    args = ["--models", "gpt2", "--steps", "2", "--seeds", "1", "--out", str(tmp_path), "--optimizers"]
    first = zoo.main([*args, "sgd"])
    again = zoo.main([*args, "sgd", "adamw"])
    assert calls == ["sgd"] * 3 + ["adamw"] * 3
    assert again["results"]["gpt2"]["sgd"] == {**first["results"]["gpt2"]["sgd"],
                                               "equal_time": again["results"]["gpt2"]["sgd"]["equal_time"]}
    assert len(again["runs"]) == 6
    with pytest.raises(SystemExit):
        zoo.main(["--models", "gpt2", "--steps", "3", "--seeds", "1", "--out", str(tmp_path), "--optimizers", "sgd"])


def test_the_goals_and_the_family_rows_count_the_models_where_kfac_is_at_or_below_its_peer() -> None:
    def s(final: float, equal_time: float, step_s: float = 1.0, start: float = 2.0) -> dict[str, float]:
        return {"final": final, "equal_time": equal_time, "step_s": step_s, "start": start}

    results = {"gpt2": {"sgd": s(1.0, 1.0), "kfac": s(0.5, 1.5), "adamw": s(1.0, 1.0), "eigen_adam": s(1.0, 1.0, 3.0)},
               "llama": {"sgd": s(1.0, 1.0), "kfac": s(2.5, 2.5), "adamw": s(1.0, 1.0), "eigen_adam": s(0.9, 1.0, 2.0)}}
    lines = zoo.goals(results)
    assert lines[0].startswith("- drop-in ≤ SGD after equal steps: 1/2 (50%)") and lines[0].endswith("above on: llama")
    assert lines[1].startswith("- drop-in ≤ SGD after equal CPU time: 0/2 (0%)")
    assert lines[2].startswith("- EigenAdam ≤ AdamW after equal steps: 2/2 (100%)")
    assert "max 3.00×" in lines[3] and lines[3].endswith("over: gpt2 3.00×")
    assert lines[4].endswith("llama kfac 2 → 2.5 (goal: never)")
    # per family: EigenAdam's equal-time 1.0 ties AdamW's on both models (ties count); its step ratios 3 and 2
    assert "| decoder | gpt2, llama | 1/2; 0/2 | 2/2; 2/2 | 1× | 2.5× |" in zoo.by_family(results)


def test_pieces_run_into_two_folders_join_into_one_table_and_a_search_in_both_is_refused(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    zoo_counting_train(monkeypatch)
    common = ["--models", "gpt2", "--steps", "2", "--seeds", "1"]
    sgd = zoo.main([*common, "--optimizers", "sgd", "--out", str(tmp_path / "a")])
    adamw = zoo.main([*common, "--optimizers", "adamw", "--out", str(tmp_path / "b")])
    joined = zoo.main([*common, "--out", str(tmp_path / "all"), "--merge", str(tmp_path / "a"), str(tmp_path / "b")])
    assert joined["results"]["gpt2"]["sgd"]["final"] == sgd["results"]["gpt2"]["sgd"]["final"]
    assert joined["results"]["gpt2"]["adamw"]["final"] == adamw["results"]["gpt2"]["adamw"]["final"]
    assert joined["runs"] == sgd["runs"] + adamw["runs"]
    assert "| gpt2 | decoder |" in (tmp_path / "all" / "zoo.md").read_text()
    with pytest.raises(SystemExit):
        zoo.main([*common, "--out", str(tmp_path / "twice"), "--merge", str(tmp_path / "a"), str(tmp_path / "a")])


def test_the_image_teacher_labels_by_colour_alone_and_uses_every_class() -> None:
    batch = ZOO["tv_vit"].batch(256, torch.Generator().manual_seed(0))
    x, labels = batch.args[0], batch.target
    assert x.shape == (256, CHANNELS, IMAGE, IMAGE) and set(labels.tolist()) == set(range(IMAGE_CLASSES))
    # the documented rule: the argmax of the teacher's fixed linear map of the channel means
    assert torch.equal(labels, (x.mean((2, 3)) @ zoo_models._projection(CHANNELS, IMAGE_CLASSES)).argmax(-1))
    moved = x.roll((3, 5), (2, 3))  # the same picture elsewhere: the same means
    assert torch.allclose(moved.mean((2, 3)), x.mean((2, 3)), atol=1e-6)


def test_muon_builds_and_steps_where_every_trainable_parameter_is_a_hidden_matrix() -> None:
    """A LoRA model trains only its adapters' 2-D matrices: Muon takes them all and AdamW's part is
    empty (it was built anyway, and ``torch.optim.AdamW`` refuses an empty parameter list)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.Linear(3, 2, bias=False))
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = zoo.build("muon", model, 1e-2)
    model(torch.randn(5, 4)).square().sum().backward()
    optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_a_variant_puts_the_parameters_outside_kfac_in_a_group_at_its_share_of_the_lr() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    variant = zoo.Variant({"momentum": 0.9}, "kfac", outside_lr=0.3)
    optimizer = zoo._variant(variant, model, 0.1, list(model.parameters()))
    norm = {id(p) for p in model[1].parameters()}
    by_group = [({id(p) for p in group["params"]}, group["lr"]) for group in optimizer.param_groups]
    assert by_group == [({id(p) for p in (*model[0].parameters(), *model[2].parameters())}, 0.1), (norm, 0.1 * 0.3)]
    assert {id(p) for block in optimizer.blocks for p in block.parameters()}.isdisjoint(norm)
    assert optimizer.param_groups[1]["momentum"] == 0.9


def zoo_pooled_conv_loss(images: torch.Tensor) -> Callable[[torch.nn.Module, slice], torch.Tensor]:
    """The cross-entropy of ``images[s]`` against class 0 (``curvature.ratios``' ``loss_of``)."""
    return lambda model, s: torch.nn.functional.cross_entropy(model(images[s]), torch.zeros(len(images[s]),
                                                                                          dtype=torch.long))


@pytest.mark.parametrize(("weight_sharing", "conv_ratio"), [("expand", 9.0), ("reduce", 1.0)])
def test_the_curvature_probe_finds_kfac_exact_on_one_sample_but_expand_t_times_low_on_identical_positions(
        weight_sharing: str, conv_ratio: float) -> None:
    # One sample, every one of the T = 9 positions the same: the per-sample gradient of the 1x1 conv is
    # Σ_t δaᵀ = T·δaᵀ, so the exact Fisher along D is T²(δᵀDa)²; expand's A = aaᵀ (the mean over rows)
    # and G = Σ_rows δδᵀ = T·δδᵀ give T(δᵀDa)², reduce's A = āāᵀ, G = (Σ_t δ)(Σ_t δ)ᵀ give T²(δᵀDa)².
    # The pooled head has one row per sample: rank-one factors, exact.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 2))
    images = torch.randn(1, 3, 1, 1).expand(1, 3, 3, 3).contiguous()
    found = curvature.ratios(model, zoo_pooled_conv_loss(images), 1, weight_sharing=weight_sharing)
    assert set(found) == {"0.weight", "3.weight"}
    assert found["0.weight"] == pytest.approx((conv_ratio, conv_ratio), rel=1e-3)
    assert found["3.weight"] == pytest.approx((1.0, 1.0), rel=1e-3)
