"""Staggered factor updates (``KFAC(..., curvature=CurvatureConfig(stagger=True))``, ``kfac_optim.estimator.stagger``):
which layers capture and fold on which step, and the factors they build."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded_batch
from torch import nn

from kfac_optim import KFAC, CurvatureConfig
from kfac_optim.estimator.stagger import assign_phases

BATCH = 8
DIMS = [(4, 6), (6, 5), (5, 3)]  # three Linear layers, statistics costs 8·(5²+6²), 8·(7²+5²), 8·(6²+3²)


def stagger_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    first, second, third = (nn.Linear(i, o, dtype=torch.float64) for i, o in DIMS)
    return nn.Sequential(first, nn.Tanh(), second, nn.Tanh(), third)


def stagger_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_batch((BATCH, 4), 3, seed=step, dtype=torch.float64)


def expected_phases(interval: int) -> list[int]:
    """From first principles: cost = rows × ((d_in + 1)² + d_out²) per layer, greedy largest first."""
    costs = [BATCH * ((i + 1) ** 2 + o**2) for i, o in DIMS]
    return assign_phases(costs, ["0", "2", "4"], interval)


def test_assign_phases_is_greedy_largest_first_with_ties_by_name() -> None:
    assert assign_phases([5.0, 3.0, 3.0, 1.0], ["a", "b", "c", "d"], 2) == [0, 1, 1, 0]
    assert assign_phases([3.0, 3.0], ["y", "x"], 2) == [1, 0]  # equal costs: "x" first, onto phase 0
    assert assign_phases([1.0, 2.0, 3.0], ["a", "b", "c"], 5) == [2, 1, 0]  # more phases than layers
    assert expected_phases(3) == [1, 0, 2] and expected_phases(2) == [1, 0, 1]


@pytest.mark.parametrize("interval", [2, 3])
def test_each_layer_captures_and_folds_only_on_its_phase_once_per_interval(interval: int) -> None:
    model = stagger_mlp()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=interval, decomposition_update_steps=4,
                     curvature=CurvatureConfig(stagger=True))
    phases = expected_phases(interval)
    versions = [0, 0, 0]
    for step in range(4 * interval + 1):
        x, y = stagger_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        captured = [block.pending_samples > 0 for block in optimizer.blocks]
        expected = [True] * 3 if step == 0 else [step % interval == p for p in phases]
        assert captured == expected, step
        assert optimizer.capturing == any(expected) and optimizer.is_factor_step(step) == any(expected)
        optimizer.step()
        folded = [block.A.version - v for block, v in zip(optimizer.blocks, versions, strict=True)]
        assert folded == [int(e) for e in expected], step
        versions = [block.A.version for block in optimizer.blocks]
    # Every window of `interval` steps after the first: every layer folded exactly once.
    assert versions == [1 + 4] * 3


def test_a_callable_interval_gets_phases_against_the_interval_in_force() -> None:
    model = stagger_mlp()
    schedule = lambda step: 2 if step < 6 else 3  # noqa: E731
    optimizer = KFAC(model, lr=0.1, factor_update_steps=schedule, curvature=CurvatureConfig(stagger=True),
                     decomposition_update_steps=10)
    for step in range(12):
        x, y = stagger_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        interval = schedule(step)
        captured = [block.pending_samples > 0 for block in optimizer.blocks]
        expected = [True] * 3 if step == 0 else [step % interval == p for p in expected_phases(interval)]
        assert captured == expected, step
        optimizer.step()


def test_staggered_factors_are_the_running_averages_of_each_layers_own_batches() -> None:
    """Dense reference: per layer, A = mean of [a, 1][a, 1]ᵀ and G = N Σ g gᵀ (g = ∂ mean loss / ∂
    output) of the batches on the steps it folds, averaged with decay 0.9 (the first: taken as is)."""
    decay, interval = 0.9, 3
    model = stagger_mlp()
    optimizer = KFAC(
        model, lr=0.1, momentum=0.9, factor_update_steps=interval, decomposition_update_steps=2,
        curvature=CurvatureConfig(factor_decay=decay, stagger=True, factor_dtype=torch.float64,
                                  inv_dtype=torch.float64),
    )
    layers = [model[0], model[2], model[4]]
    phases = expected_phases(interval)
    reference: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * 3
    for step in range(10):
        x, y = stagger_batch(step)
        # First principles: the layers' inputs and output-gradients at the current weights.
        inputs, outputs, h = [], [], x
        for index, layer in enumerate(layers):
            inputs.append(h)
            out = F.linear(h, layer.weight.detach(), layer.bias.detach()).requires_grad_()
            outputs.append(out)
            h = torch.tanh(out) if index < 2 else out
        grads = torch.autograd.grad(F.cross_entropy(h, y), outputs)
        for index, (a, g) in enumerate(zip(inputs, grads, strict=True)):
            if step > 0 and step % interval != phases[index]:
                continue
            rows = torch.cat([a, torch.ones(BATCH, 1, dtype=a.dtype)], 1)
            A, G = rows.T @ rows / BATCH, BATCH * g.T @ g
            old = reference[index]
            reference[index] = (A, G) if old is None else (decay * old[0] + (1 - decay) * A,
                                                           decay * old[1] + (1 - decay) * G)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    for block, (A, G) in zip(optimizer.blocks, reference, strict=True):
        torch.testing.assert_close(block.A.running, A, rtol=1e-10, atol=1e-12, msg=block.name)
        torch.testing.assert_close(block.G.running, G, rtol=1e-10, atol=1e-12, msg=block.name)


def test_attention_projections_share_one_phase_and_are_captured_together() -> None:
    torch.manual_seed(0)
    embed = nn.Linear(3, 8)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    head = nn.Linear(8, 2)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.attention, self.head = embed, attention, head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            return self.head(self.attention(h, h, h, need_weights=False)[0].mean(1))

    model = Net()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=2, curvature=CurvatureConfig(stagger=True),
                     decomposition_update_steps=10)
    names = [block.name for block in optimizer.blocks]
    attention_blocks = [i for i, name in enumerate(names) if name.startswith("attention")]
    assert len(attention_blocks) >= 2
    seen = set()
    for step in range(5):
        x = torch.randn(4, 5, 3)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        captured = [block.pending_samples > 0 for block in optimizer.blocks]
        assert len({captured[i] for i in attention_blocks}) == 1, (step, captured)
        if step > 0:
            assert sum(captured) < len(captured), step  # two phases: never all at once
            seen.add(tuple(captured))
        optimizer.step()
    assert len(seen) == 2  # both phases occur, and together they cover every block
    assert all(any(c[i] for c in seen) for i in range(len(names)))


def test_sampled_fisher_records_only_the_layers_of_the_phase() -> None:
    model = stagger_mlp()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=3, curvature=CurvatureConfig(fisher="sampled", stagger=True),
                     decomposition_update_steps=10)
    phases = expected_phases(3)
    for step in range(7):
        x, y = stagger_batch(step)
        optimizer.zero_grad()
        out = model(x)
        optimizer.sample_fisher(out, "cross_entropy", generator=torch.Generator().manual_seed(step))
        F.cross_entropy(out, y).backward()
        captured = [block.pending_samples > 0 for block in optimizer.blocks]
        assert captured == ([True] * 3 if step == 0 else [step % 3 == p for p in phases]), step
        optimizer.step()
