"""``KFAC(runtime=RuntimeConfig(async_statistics=True))``: statistics on a worker thread (docs/design.md §4).

The contract is exactness: the worker runs the same work in the same order as the in-line mode,
so parameters and factors must be bit-identical (``torch.equal``) to an in-line run of the same
loop, across the features whose statistics have per-backward bookkeeping (weight sharing, sample
counts over several backward passes, the sampled Fisher, GradScaler's correction, custom blocks).
Faults: a pair modified in place before the worker reads it is dropped with a warning; a failure
in the worker is raised on the optimizer's thread.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest_apex import fake_apex, scaled_step  # noqa: F401  (fake_apex is a fixture)
from torch import Tensor, nn

from kfac_optim import KFAC, AsyncConfig, CurvatureConfig, RuntimeConfig


class SharedLinear(nn.Module):
    """A conv feeding a Linear that is called twice per forward (an RNN cell's weight sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.cell = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = F.adaptive_avg_pool2d(torch.relu(self.conv(x)), 2).flatten(1)  # (N, 16)
        h = torch.tanh(self.cell(torch.tanh(self.cell(h))))
        return self.head(h)


class TinyTransformer(nn.Module):
    """Embedding, attention (its own capture taps), LayerNorm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        h = self.norm(h + self.attention(h, h, h, need_weights=False)[0])
        return self.head(h.mean(1))


Batch = tuple[Tensor, Tensor]


def image_batches(steps: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, 8, 8, generator=generator), torch.randint(0, 5, (6,), generator=generator))
            for _ in range(steps)]


def token_batches(steps: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 11, (6, 7), generator=generator), torch.randint(0, 5, (6,), generator=generator))
            for _ in range(steps)]


def plain_step(model: nn.Module, optimizer: KFAC, x: Tensor, y: Tensor) -> None:
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def accumulated_step(model: nn.Module, optimizer: KFAC, x: Tensor, y: Tensor) -> None:
    """Two micro-batches, two backward passes, one step."""
    optimizer.zero_grad()
    for part_x, part_y in zip(x.chunk(2), y.chunk(2), strict=True):
        (F.cross_entropy(model(part_x), part_y) / 2).backward()
    optimizer.step()


def sampled_fisher_step(model: nn.Module, optimizer: KFAC, x: Tensor, y: Tensor) -> None:
    optimizer.zero_grad()
    out = model(x)
    optimizer.sample_fisher(out, "cross_entropy", generator=torch.Generator().manual_seed(optimizer.steps))
    F.cross_entropy(out, y).backward()
    optimizer.step()


def grad_scaler_step(model: nn.Module, optimizer: KFAC, x: Tensor, y: Tensor) -> None:
    scaler = optimizer.test_scaler  # type: ignore[attr-defined]
    optimizer.zero_grad()
    scaler.scale(F.cross_entropy(model(x), y)).backward()
    scaler.step(optimizer)
    scaler.update()


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[int], list[Batch]], Callable[..., None], dict[str, Any]]] = {
    "plain": (SharedLinear, image_batches, plain_step, {}),
    "async decompositions, delay 1": (SharedLinear, image_batches, plain_step, dict(asynchronous=AsyncConfig(delay=1))),
    "staggered factor steps": (SharedLinear, image_batches, plain_step, dict(curvature=CurvatureConfig(stagger=True))),
    "weight sharing reduce": (SharedLinear, image_batches, plain_step,
                              dict(curvature=CurvatureConfig(weight_sharing="reduce"))),
    "accumulated micro-batches": (SharedLinear, image_batches, accumulated_step, {}),
    "sampled fisher": (SharedLinear, image_batches, sampled_fisher_step,
                       dict(curvature=CurvatureConfig(fisher="sampled"))),
    "grad scaler": (SharedLinear, image_batches, grad_scaler_step, {}),
    "transformer blocks": (TinyTransformer, token_batches, plain_step, {}),
}


def train_case(case: str, async_statistics: bool, steps: int = 9) -> tuple[list[Tensor], dict[str, Any]]:
    factory, batches, step, options = CASES[case]
    torch.manual_seed(0)
    model = factory()
    optimizer = KFAC(model, lr=0.1, momentum=0.9, factor_update_steps=2, decomposition_update_steps=4,
                     runtime=RuntimeConfig(async_statistics=async_statistics), **options)
    if step is grad_scaler_step:
        optimizer.test_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # type: ignore[attr-defined]
    for x, y in batches(steps):
        step(model, optimizer, x, y)
    return [p.detach().clone() for p in model.parameters()], optimizer.state_dict()["kfac"]


def saved_running_factors(kfac_state: dict[str, Any]) -> dict[str, Tensor]:
    return {f"{block}.{name}": factor["running"] for block, state in kfac_state["blocks"].items()
            for name, factor in state["factors"].items()}


@pytest.mark.parametrize("case", list(CASES))
def test_async_statistics_train_bit_identically_to_in_line(case: str) -> None:
    in_line_params, in_line_state = train_case(case, async_statistics=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no dropped pair
        params, state = train_case(case, async_statistics=True)
    assert all(torch.equal(a, b) for a, b in zip(in_line_params, params, strict=True))
    in_line_factors, factors = saved_running_factors(in_line_state), saved_running_factors(state)
    assert in_line_factors.keys() == factors.keys()
    for key, factor in factors.items():
        assert torch.equal(factor, in_line_factors[key]), key
        assert factor.abs().sum() > 0, f"{key} never updated: the comparison proves nothing"


def blocked_worker(optimizer: KFAC) -> threading.Event:
    """Hold the optimizer's statistics worker until the returned event is set."""
    release = threading.Event()
    optimizer.estimator.statistics.worker.submit(release.wait)  # type: ignore[union-attr]
    return release


def test_an_input_refilled_in_place_before_the_worker_reads_it_is_dropped_with_a_warning() -> None:
    torch.manual_seed(0)
    model = SharedLinear()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=1,
                     runtime=RuntimeConfig(async_statistics=True))
    (x, y), (x2, _) = image_batches(2)
    plain_step(model, optimizer, x, y)
    conv_a = optimizer.blocks[0].A.running.clone()
    cell_a = optimizer.blocks[1].A.running.clone()

    buffer = x.clone()
    release = blocked_worker(optimizer)
    optimizer.zero_grad()
    F.cross_entropy(model(buffer), y).backward()
    buffer.copy_(x2)  # the loader refills its buffer before the worker read the pair
    release.set()
    with pytest.warns(RuntimeWarning, match=r"\['conv'\]: an input or output-gradient was modified in place"):
        optimizer.step()
    optimizer.step()  # the decomposition step waits for the worker: the drop is known by now
    assert torch.equal(optimizer.blocks[0].A.running, conv_a), "the dropped pair was folded"
    assert not torch.equal(optimizer.blocks[1].A.running, cell_a), "the other layers' pairs were not"
    assert all(torch.isfinite(f.running).all() for b in optimizer.blocks for f in b.factors.values())


def test_a_failure_in_the_worker_is_raised_on_the_optimizers_thread() -> None:
    torch.manual_seed(0)
    model = SharedLinear()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=2,
                     runtime=RuntimeConfig(async_statistics=True))

    def broken(inputs: Tensor, grad_output: Tensor) -> None:
        raise ValueError("a custom block's statistics failed")

    optimizer.blocks[2].accumulate = broken  # type: ignore[method-assign]
    x, y = image_batches(1)[0]
    with pytest.raises(RuntimeError, match="statistics worker") as raised:
        for _ in range(3):
            plain_step(model, optimizer, x, y)
    assert isinstance(raised.value.__cause__, ValueError)


def test_state_dict_waits_for_the_worker() -> None:
    torch.manual_seed(0)
    model = SharedLinear()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=10,
                     runtime=RuntimeConfig(async_statistics=True))
    (x, y), (x2, y2) = image_batches(2)
    plain_step(model, optimizer, x, y)  # step 0 decomposes, so it waits for the worker
    version, running = optimizer.blocks[0].A.version, optimizer.blocks[0].A.running.clone()
    release = blocked_worker(optimizer)
    plain_step(model, optimizer, x2, y2)  # step 1 folds: queued behind the blocked worker
    assert optimizer.blocks[0].A.version == version
    threading.Timer(0.2, release.set).start()
    state = optimizer.state_dict()["kfac"]
    assert state["blocks"]["conv"]["factors"]["A"]["version"] == version + 1
    assert not torch.equal(state["blocks"]["conv"]["factors"]["A"]["running"], running)


def test_under_apex_the_statistics_are_computed_in_line_with_one_warning(fake_apex: ModuleType) -> None:
    def run(async_statistics: bool) -> list[Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        optimizer = KFAC(model, lr=0.05, decomposition_update_steps=2,
                         runtime=RuntimeConfig(async_statistics=async_statistics),
                         factor_update_steps=1)
        model, optimizer = fake_apex.initialize(model, optimizer, opt_level="O2", verbosity=0)
        generator = torch.Generator().manual_seed(3)
        for _ in range(4):
            x = torch.randn(16, 8, generator=generator)
            scaled_step(fake_apex, model, optimizer, x, torch.randint(0, 3, (16,), generator=generator))
        return [f.running.clone() for b in optimizer.blocks for f in b.factors.values()]

    in_line = run(False)
    with pytest.warns(UserWarning, match="does not apply under Apex amp") as record:
        factors = run(True)
    assert sum("does not apply under Apex" in str(w.message) for w in record) == 1
    assert all(torch.equal(a, b) for a, b in zip(in_line, factors, strict=True))
