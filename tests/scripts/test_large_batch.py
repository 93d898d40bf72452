"""``python -m benchmarks.large_batch``'s arithmetic: the critical batch, the lr grid's widening,
the generated data and the projection's byte counts (no training: a run takes too long for the suite)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.comm_bytes import comm_bytes
from benchmarks.large_batch import projection, study
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


def test_the_grid_is_the_peers_grid_and_one_point_above_it_from_four_times_the_smallest_batch() -> None:
    base = optimizers.lr_grid("sgd", 3)
    assert study.grid("sgd", 256, 128, 3) == base
    widened = study.grid("sgd", 512, 128, 3)
    assert widened[:3] == base and widened[3] == pytest.approx(base[-1] * 10 ** 0.5, rel=1e-2)


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
