"""The measurement scripts run end to end on tiny settings and report what they measured.

Numbers are not asserted against targets (timings belong to the benchmarks, not the tests);
what is asserted is structure and the quantities fixed by definition: payload bytes from factor
sizes, which rank computes what, and per-rank bytes that differ between strategies.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import (
    amp_steps,
    comm_bytes,
    compiled_steps,
    conv_statistics,
    cost_constants,
    default_cost,
    interval_rules,
    peer_steps,
    scaling,
    step_time,
    whole_steps,
)
from kfac_optim.optimizer import block_dims
from kfac_optim.schedule.intervals import AutoIntervals, StepCosts


def test_comm_bytes_counts_packed_triangles_and_whole_factors() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(10, 6, bias=False))
    dims = block_dims(model)
    assert dims == {"0": (28, 4), "2": (10, 6)}
    numbers = comm_bytes.comm_bytes(dims)
    sizes = [28, 4, 10, 6]
    assert numbers["factor_allreduce_unpacked"] == 4 * sum(n * n for n in sizes) + 4 * len(sizes)
    assert numbers["factor_allreduce_packed"] == 4 * sum(n * (n + 1) // 2 for n in sizes) + 4 * len(sizes)
    assert numbers["gradient_broadcast_per_step_mem_opt"] == 4 * (28 * 4 + 10 * 6)


@pytest.mark.parametrize(("world", "mean", "largest"), [(2, 24, 24), (4, 18, 36)])
def test_comm_bytes_counts_fsdp_rows_to_and_from_the_preconditioner(world: int, mean: int, largest: int) -> None:
    """One layer with a (4, 3) joint gradient (G: 4, A: 3): its preconditioner receives the other
    shards' ceil(4/world) rows, every other rank receives its own rows back; fp32."""
    numbers = comm_bytes.fsdp_bytes({"layer": (3, 4)}, param_bytes=1000, world=world, fraction=1.0)
    rows = 4 * -(-4 // world) * 3
    assert numbers["kfac_rows_per_step_max"] == (world - 1) * rows == largest
    assert numbers["kfac_rows_per_step_mean"] == 2 * (world - 1) * rows / world == mean
    assert numbers["fsdp_reduce_scatter_per_step"] == 1000 * (world - 1) / world
    assert numbers["fsdp_all_gather_per_step"] == 2 * numbers["fsdp_reduce_scatter_per_step"]


def test_default_cost_times_the_large_batch_mlp_interleaved_with_sgd(tmp_path: Path) -> None:
    """``--model mlp1d``: both optimizers take every step, on batches of the size asked for."""
    out = tmp_path / "default_cost.json"
    result = default_cost.main(["--model", "mlp1d", "--batch", "8", "--steps", "3", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["batch"] == result["batch"] == 8
    assert len(saved["sgd_step_s"]) == len(saved["kfac_step_s"]) == 3
    assert saved["ratio"] == pytest.approx(saved["kfac_mean_s"] / saved["sgd_mean_s"])


def test_step_time_reports_every_part_and_the_whole_step(tmp_path: Path) -> None:
    out = tmp_path / "step_time.json"
    result = step_time.main(["--model", "mlp", "--image-size", "4", "--batch-size", "8", "--repeats", "1",
                             "--budget", "0.05", "--json", str(out)])
    saved = json.loads(out.read_text())
    expected = {"sgd_step", "statistics", "fold", "decomposition_eigen", "precondition_inverse",
                "clip_update", "whole_non_factor_step", "sample_fisher", "sample_fisher_floor"}
    assert expected <= set(saved["timings"]) and expected <= set(result["timings"])
    assert all(t["median"] > 0 for key, t in saved["timings"].items() if key in expected)
    # the step that decomposes, whole: at least its decompositions, and longer than SGD's step
    for method in ("eigen", "inverse"):
        (row,) = [r for r in result["table"] if r[0] == f"decomposition step ({method}), whole"]
        assert float(row[1]) >= 1e3 * saved["timings"][f"decomposition_{method}"]["median"]
        assert result["goals"][f"decomposition_step_{method}_over_sgd"] == pytest.approx(
            float(row[1]) / (1e3 * saved["timings"]["sgd_step"]["median"]), rel=1e-2)
    assert saved["goals"]["whole_non_factor_step_over_parts"] > 0


def test_peer_steps_times_the_three_optimizers_and_breaks_down_kfacs_step(tmp_path: Path) -> None:
    out = tmp_path / "peer_steps.json"
    payload = peer_steps.main(["--tasks", "mlp", "--steps", "2", "--warmup", "1", "--profile-steps", "2",
                               "--json", str(out)])
    result = json.loads(out.read_text())["results"]["mlp"]
    assert result == json.loads(json.dumps(payload["results"]["mlp"]))
    assert all(result[name]["mean_ms"] > 0 for name in ("sgd", "adamw", "kfac"))
    assert result["kfac_breakdown_ms"]["kfac.precondition"] > 0  # the step after the first decomposition
    # 64-256-256-10 with biases: A 65/257/257, G 256/256/10, four rotations of each side
    flop = sum(4 * o * o * i + 4 * o * i * i for o, i in ((256, 65), (256, 257), (10, 257)))
    assert result["preconditioning_gflop"] == pytest.approx(flop / 1e9)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_scaling_times_every_rank_and_counts_what_each_strategy_sends(tmp_path: Path) -> None:
    report = scaling.main(["--model", "mlp", "--image-size", "4", "--batch-size", "8", "--worlds", "1", "2",
                           "--steps", "1", "--warmup", "0", "--plan-worlds", "8", "--out", str(tmp_path)])
    assert (tmp_path / "scaling.json").exists() and (tmp_path / "scaling.png").stat().st_size > 0
    rows = {(r["world_size"], r["grad_worker_fraction"]): r for r in report["measured"]}
    assert set(rows) == {(1, "-"), (2, "comm-opt"), (2, "mem-opt")}
    single = rows[(1, "-")]["ranks"][0]
    assert single["owned_factors"] == 6 and sum(single["bytes_per_step"].values()) == 0
    for fraction in ("comm-opt", "mem-opt"):
        ranks = rows[(2, fraction)]["ranks"]
        assert sum(r["owned_factors"] for r in ranks) == 6  # each factor decomposed by one rank
        assert all(r["bytes_per_step"]["factor all-reduce"] > 0 for r in ranks)
    assert all(r["bytes_per_step"]["share gradients"] == 0 for r in rows[(2, "comm-opt")]["ranks"])  # f = 1
    assert sum(r["bytes_per_step"]["share gradients"] for r in rows[(2, "mem-opt")]["ranks"]) > 0
    assert [r["world_size"] for r in report["planned"]["rows"]] == [8, 8]


def test_amp_steps_compares_fp16_with_fp32_and_writes_json_and_a_plot(tmp_path: Path) -> None:
    runs = amp_steps.main(["--steps", "6", "--batch", "16", "--init-scale", str(2.0**40), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "amp_steps.json").read_text())
    assert [run["summary"]["run"] for run in saved] == ["fp32", "fp16+GradScaler"]
    assert (tmp_path / "amp_steps.png").stat().st_size > 0
    fp32, fp16 = (run["summary"] for run in runs)
    assert fp32["skipped"] == 0 and fp32["optimizer_steps"] == 6
    # A scale of 2^40 overflows fp16 gradients: the first steps are skipped and the scale falls.
    assert fp16["skipped_at"][0] == 0 and fp16["optimizer_steps"] == 6 - fp16["skipped"]
    assert fp16["final_scale"] < 2.0**40
    assert all(len(run["train_loss"]) == 6 for run in saved)


def test_whole_steps_times_each_run_and_compares_rank_aware_preconditioning(tmp_path: Path) -> None:
    payload = whole_steps.main(["--model", "mlp", "--image-size", "4", "--batch-size", "8", "--steps", "3",
                                "--factor-interval", "2", "--inverse-interval", "2",
                                "--runs", "sync", "async", "async-stagger", "async-statistics",
                                "--precondition", "--repeats", "1",
                                "--out", str(tmp_path)])
    runs = payload["runs"]
    assert set(runs) == {"sync", "async", "async-stagger", "async-statistics"}
    assert all(len(r["times_s"]) == 3 and r["first_s"] > 0 for r in runs.values())
    precondition = runs["sync"]["precondition"]
    # 3·4·4 = 48 inputs + bias, 2 folds of 8 rows: A's rank ≤ 16 ≤ 49/2, held thin; full is 49 columns.
    # (factor interval 2: staggering at interval 1 is a contradiction, a ValueError)
    assert precondition["dim_and_columns"]["1.A"][0] == 49 and precondition["dim_and_columns"]["1.A"][1] < 49
    assert (tmp_path / "whole_steps.json").exists() and (tmp_path / "whole_steps.png").exists()


def test_norm_blocks_trains_every_variant_and_writes_json_and_a_plot(tmp_path: Path) -> None:
    from benchmarks import norm_blocks

    runs = norm_blocks.main(["--steps", "3", "--seeds", "0", "--batch", "4", "--length", "8", "--dim", "8",
                             "--out", str(tmp_path)])
    assert [r["variant"] for r in runs] == ["adamw", "kfac", "kfac+norm"]
    assert all(len(r["losses"]) == 3 and r["held_out_loss"] > 0 for r in runs)
    assert (tmp_path / "norm_blocks.json").exists() and (tmp_path / "norm_blocks.png").exists()


def test_time_to_metric_finds_the_first_epoch_reaching_the_reference_final(tmp_path: Path) -> None:
    from benchmarks import time_to_metric

    histories = {
        "adamw": [(1.0, 0.5, 0.01), (2.0, 0.9, 0.01), (3.0, 0.8, 0.01)],  # final 0.8, first reached at 2.0 s
        "kfac": [(1.0, 0.85, 0.02), (2.0, 0.7, 0.02)],  # reaches 0.8 at 1.0 s
        "sgd": [(1.0, 0.1, 0.005)],  # never
    }
    for run, rows in histories.items():
        (tmp_path / run).mkdir()
        (tmp_path / run / "metrics.jsonl").write_text("\n".join(
            json.dumps({"time_s": t, "test_acc": acc, "step_s": step}) for t, acc, step in rows))
    report = time_to_metric.main([str(tmp_path), "--out", str(tmp_path / "out.json")])
    runs = report["folders"][0]["runs"]
    assert report["folders"][0]["target"] == 0.8
    assert runs["adamw"]["time_s"] == 2.0 and runs["kfac"]["time_ratio"] == 0.5 and runs["kfac"]["step_ratio"] == 2.0
    assert runs["sgd"]["time_s"] is None and report["summary"]["sgd"]["reached"] == "0/1"


def test_compiled_steps_times_the_compiled_model_with_and_without_the_capture(tmp_path: Path) -> None:
    out = tmp_path / "compiled_steps.json"
    result = compiled_steps.main(["--model", "gpt", "--backend", "eager", "--fullgraph", "--batch-size", "2",
                                  "--steps", "3", "--warmup", "1", "--rounds", "1", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["graphs"] == result["graphs"] == {"sgd": 1, "kfac": 1}
    kfac = saved["runs"]["kfac"]
    assert kfac["per_step"]["factor_step"] == [False, True]  # factor interval 2, after the warmup step (armed)
    assert kfac["forward_backward_factor_steps_s"] > 0 and kfac["forward_backward_other_steps_s"] > 0
    assert saved["runs"]["sgd"]["whole_step_s"] > 0


def test_cost_constants_measures_each_kind_of_work_against_the_librarys_constants(tmp_path: Path) -> None:
    result = cost_constants.main(["--sizes", "16", "160", "--repeats", "1", "--out", str(tmp_path)])
    assert result["library"] == cost_constants.LIBRARY
    assert set(result["constants"]) == {"eigh", "inverse", "range", "element"}
    assert set(result["constants"]["range"]) == {160}  # the cap's eigensolver: sizes above max_rank only
    assert all(value > 0 for by_size in result["constants"].values() for value in by_size.values())
    assert json.loads((tmp_path / "cost_constants.json").read_text())["rate_flop_per_s"] > 0
    assert (tmp_path / "cost_constants.png").stat().st_size > 0


def test_interval_rules_runs_each_rule_beside_sgd_and_reports_the_intervals_it_chose(tmp_path: Path) -> None:
    pytest.importorskip("torchvision")
    results = interval_rules.main(["--models", "tv_regnet", "--rules", "fixed_5_50", "--steps", "1",
                                   "--seeds", "1", "--out", str(tmp_path)])
    by_rule = results["tv_regnet"]
    assert set(by_rule) == {"sgd", "fixed_5_50"} and by_rule["sgd"]["step_ratio"] == 1.0
    assert by_rule["fixed_5_50"]["intervals"] == "factor_update_steps=5, decomposition_update_steps=50"
    assert "| tv_regnet | fixed_5_50 |" in (tmp_path / "interval_rules.md").read_text()


def test_the_earlier_budget_rule_put_both_intervals_at_their_caps_when_the_preconditioning_filled_it() -> None:
    costs = StepCosts(step=0.1, factor=0.05, decomposition=3.5, precondition=0.06)  # P over 0.5 · step
    assert interval_rules.BudgetWithPreconditioning().choose(costs, None, None) == (50, 500)
    # the library's rule: the preconditioning takes half the budget, share (0.05 − 0.025)/2 = 0.0125
    assert AutoIntervals().choose(costs, None, None) == (4, 280)
    # the preconditioning outside the budget: share 0.025
    assert interval_rules.PreconditioningOnTop().choose(costs, None, None) == (2, 140)


def test_conv_statistics_times_each_kind_and_trains_with_each(tmp_path: Path) -> None:
    payload = conv_statistics.main(["--model", "resnet18", "--size", "16", "--batch", "2", "--repeats", "1",
                                    "--kinds", "expand,reduce", "--steps", "2", "--seeds", "0", "--out", str(tmp_path)])
    assert set(payload["cost"]["kinds"]) == {"expand", "reduce"}
    assert (set(payload["cost"]["kinds"]["reduce"]["per_layer_s"])
            == set(payload["cost"]["kinds"]["expand"]["per_layer_s"]))
    for task in ("cnn", "cnn32"):
        assert [len(losses) for losses in payload["progress"]["tasks"][task]["kinds"]["reduce"]["losses"]] == [2]
    assert json.loads((tmp_path / "both.json").read_text())["cost"]["batch"] == 2
    assert (tmp_path / "both.png").exists()


def test_dropin_lr_trains_each_variant_at_every_lr_and_reports_the_length_ratios() -> None:
    from benchmarks import dropin_lr

    results = dropin_lr.main(["--tasks", "regression", "--variants", "sgd", "lr_squared", "floor", "--momenta", "0",
                              "--steps", "2", "--seeds", "1", "--ratios"])
    assert list(results) == ["regression momentum=0.0 sgd", "regression momentum=0.0 lr_squared",
                             "regression momentum=0.0 floor"]
    # the alternative rule replaces the default's for that optimizer only
    floor, default = (dropin_lr.final_loss("regression", v, 0.01, 0.0, 0, 2) for v in ("floor", "default"))
    assert floor != default and dropin_lr.final_loss("regression", "default", 0.01, 0.0, 0, 2) == default
    assert all(list(row) == [str(lr) for lr in dropin_lr.LRS] and all(v > 0 for v in row.values())
               for row in results.values())
    ratios = dropin_lr.length_ratios("regression", "lr_squared", 0.01, steps=2)
    assert len(ratios) == 2 and all(r > 0 for r in ratios)
