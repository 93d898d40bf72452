"""Native mixed precision (docs/design.md §6): ``torch.amp.GradScaler("cpu")`` with fp16 autocast, bf16.

Every test compares a run with a control run (another loss scale, fp32, plain SGD, or one process
on the concatenated batch) instead of numbers copied from a previous run.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import running_factors, seeded_batch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kfac_optim import KFAC, CurvatureConfig, RuntimeConfig
from tests.distributed_helpers import spawn

OPTIONS: dict[str, Any] = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.1, decomposition_update_steps=2)
BATCH = 16


class AmpNet(nn.Module):
    """Conv → ReLU → Linear → tanh → Linear on 1×8×8 inputs: three K-FAC blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.fc1 = nn.Linear(3 * 8 * 8, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(F.relu(self.conv(x)).flatten(1))))


def make_amp_net() -> AmpNet:
    torch.manual_seed(0)
    return AmpNet()


def amp_batch(step: int, size: int = BATCH) -> tuple[Tensor, Tensor]:
    return seeded_batch((size, 1, 8, 8), 10, seed=100 + step)


def amp_run(
    steps: int,
    *,
    dtype: torch.dtype | None = torch.float16,
    init_scale: float | None = 2.0**16,
    unscale_first: bool = False,
    pass_scaler: bool = False,
    inject_inf_at: int | None = None,
    model: nn.Module | None = None,
    make_optimizer: Callable[..., torch.optim.Optimizer] = KFAC,
    fisher: str = "empirical",
) -> tuple[nn.Module, Any, torch.amp.GradScaler | None]:
    """Train ``steps`` batches; ``dtype``: autocast dtype (None: fp32); ``init_scale`` None: no scaler;
    ``fisher="sampled"``: K-FAC's sampled Fisher with targets drawn from a per-step generator."""
    model = model or make_amp_net()
    scaler = None if init_scale is None else torch.amp.GradScaler("cpu", init_scale=init_scale)
    extra = {"runtime": RuntimeConfig(grad_scaler=scaler)} if pass_scaler else {}
    if fisher != "empirical":
        extra["curvature"] = CurvatureConfig(fisher=fisher)
    optimizer = (make_optimizer(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS},
                                **extra)
                 if make_optimizer is KFAC else make_optimizer(model))
    input_dtype = next(model.parameters()).dtype
    for step in range(steps):
        x, y = amp_batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x.to(input_dtype))
            if fisher == "sampled":
                optimizer.sample_fisher(out, "cross_entropy", generator=torch.Generator().manual_seed(step))
            loss = F.cross_entropy(out.float(), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
            continue
        scaler.scale(loss).backward()
        if step == inject_inf_at:
            model.fc1.weight.grad[0, 0] = float("inf")
        if unscale_first:
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e6)
        scaler.step(optimizer)
        scaler.update()
    return model, optimizer, scaler


def step_state(model: nn.Module, optimizer: KFAC) -> dict[str, Any]:
    """Everything a step may change: parameters, momentum, factors, decompositions, step count."""
    state: dict[str, Any] = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for p, s in optimizer.state.items():
        state[f"momentum.{id(p)}"] = s["momentum_buffer"].clone()
    for block in optimizer.blocks:
        for name, factor in block.factors.items():
            state[f"{block.name}.{name}"] = factor.running.clone()
            state[f"{block.name}.{name}.initialized"] = factor.initialized.clone()
            if factor.decomposition is not None:
                state[f"{block.name}.{name}.Q"] = factor.decomposition.Q.clone()
    state["steps"] = optimizer.steps
    return state




def params(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def change_error(model: nn.Module, reference: nn.Module, start: dict[str, Tensor]) -> dict[str, float]:
    """Per parameter, ``‖Δ − Δ_ref‖ / ‖Δ_ref‖`` for the changes ``Δ`` from ``start`` of ``model`` and of
    the control run ``reference``: 1 for a model that did not train, ~0.6 for plain SGD's steps here."""
    changes = {n: p.float() - start[n] for n, p in params(reference).items()}
    return {n: float((p.float() - start[n] - changes[n]).norm() / changes[n].norm()) for n, p in params(model).items()}


def test_factors_and_the_update_do_not_depend_on_the_initial_loss_scale() -> None:
    model_low, opt_low, _ = amp_run(4, init_scale=2.0**8)
    model_high, opt_high, _ = amp_run(4, init_scale=2.0**16)
    assert opt_high.steps == opt_low.steps == 4
    torch.testing.assert_close(running_factors(opt_low), running_factors(opt_high), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(params(model_low), params(model_high), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("dtype", "init_scale", "tolerance"),
    [
        (torch.float16, 2.0**16, dict(rtol=2e-2, atol=2e-3)),  # fp16 with a GradScaler
        (torch.bfloat16, None, dict(rtol=5e-2, atol=1e-2)),  # bf16, no scaler
    ],
    ids=["fp16-scaler", "bf16"],
)
@pytest.mark.parametrize("fisher", ["empirical", "sampled"])
def test_autocast_is_close_to_fp32_with_fp32_factors(
    dtype: torch.dtype, init_scale: float | None, tolerance: dict[str, float], fisher: str
) -> None:
    start = {n: p.detach().clone() for n, p in make_amp_net().named_parameters()}
    model_amp, opt_amp, _ = amp_run(4, dtype=dtype, init_scale=init_scale, fisher=fisher)
    model_fp32, opt_fp32, _ = amp_run(4, dtype=None, init_scale=None, fisher=fisher)
    for name, factor in running_factors(opt_amp).items():
        assert factor.dtype is torch.float32
        torch.testing.assert_close(factor, running_factors(opt_fp32)[name], **tolerance)
    torch.testing.assert_close(params(model_amp), params(model_fp32), **tolerance)
    # The steps themselves, not only where they end: 4 steps move a parameter by less than the
    # tolerance above, so an untrained model would pass that.
    assert max(change_error(model_amp, model_fp32, start).values()) < 0.1


def test_an_injected_inf_skips_the_step_leaves_all_state_untouched_and_halves_the_scale() -> None:
    model, optimizer, scaler = amp_run(3)
    before, scale = step_state(model, optimizer), scaler.get_scale()
    x, y = amp_batch(3)
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    model.fc1.weight.grad[0, 0] = float("nan")
    scaler.step(optimizer)
    scaler.update()
    torch.testing.assert_close(step_state(model, optimizer), before, rtol=0, atol=0)
    assert all(block.pending_samples == 0 for block in optimizer.blocks)
    assert scaler.get_scale() == scale / 2


def test_a_skipped_overflow_step_leaves_no_stale_statistics_for_the_next_step() -> None:
    model, optimizer, _ = amp_run(5, inject_inf_at=2)  # batches 0, 1, (2 skipped), 3, 4
    control_model = make_amp_net()
    control = KFAC(control_model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    scaler = torch.amp.GradScaler("cpu")
    for step in (0, 1, 3, 4):
        x, y = amp_batch(step)
        control.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(control_model(x), y)
        scaler.scale(loss).backward()
        scaler.step(control)
        scaler.update()
    assert optimizer.steps == control.steps == 4
    torch.testing.assert_close(running_factors(optimizer), running_factors(control), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(params(model), params(control_model), rtol=1e-5, atol=1e-7)


def test_unscale_first_with_grad_scaler_equals_letting_scaler_step_unscale() -> None:
    model_clip, opt_clip, _ = amp_run(4, unscale_first=True, pass_scaler=True)
    model_plain, opt_plain, _ = amp_run(4)
    torch.testing.assert_close(running_factors(opt_clip), running_factors(opt_plain), rtol=0, atol=0)
    torch.testing.assert_close(params(model_clip), params(model_plain), rtol=0, atol=0)


def test_unscale_first_without_grad_scaler_warns_and_drops_the_statistics() -> None:
    with pytest.warns(RuntimeWarning, match="grad_scaler=scaler") as record:
        _, optimizer, _ = amp_run(2, unscale_first=True)
    assert {w.filename for w in record} == {__file__}  # the loop's scaler.step line, not torch's
    assert optimizer.steps == 2
    assert not any(bool(f.initialized) for b in optimizer.blocks for f in b.factors.values())


def test_with_kfac_off_the_update_is_sgd_with_grad_scaler_bit_for_bit() -> None:
    def kfac_without_blocks(model: nn.Module) -> KFAC:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return KFAC(model, lr=0.05, momentum=0.9, weight_decay=1e-3,
                        curvature=CurvatureConfig(skip_layers=[nn.Linear, nn.Conv2d]), factor_update_steps=1,
                        decomposition_update_steps=10)

    def sgd(model: nn.Module) -> torch.optim.SGD:
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)

    model_kfac, _, _ = amp_run(4, inject_inf_at=1, make_optimizer=kfac_without_blocks)
    model_sgd, _, _ = amp_run(4, inject_inf_at=1, make_optimizer=sgd)
    torch.testing.assert_close(params(model_kfac), params(model_sgd), rtol=0, atol=0)


def test_bf16_parameters_keep_their_dtype_while_factors_stay_fp32() -> None:
    """The fp32 control starts from the bf16 model's (rounded) parameters; 8 steps move them well
    past bf16's rounding, so the steps' own agreement is checked (``change_error``), not only
    where they end."""
    model = make_amp_net().to(torch.bfloat16)
    reference = copy.deepcopy(model).float()
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    model, optimizer, _ = amp_run(8, dtype=None, init_scale=None, model=model)
    reference, _, _ = amp_run(8, dtype=None, init_scale=None, model=reference)
    assert all(p.dtype is torch.bfloat16 for p in model.parameters())
    assert all(f.dtype is torch.float32 for f in running_factors(optimizer).values())
    for name, param in params(model).items():
        torch.testing.assert_close(param.float(), params(reference)[name], rtol=5e-2, atol=2e-2)
    assert max(change_error(model, reference, start).values()) < 0.3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_statistics_under_autocast_are_grams_of_the_upcast_captured_tensors(dtype: torch.dtype) -> None:
    model = make_amp_net()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    block = optimizer.blocks[-1]  # fc2: its output, hence its output-gradient, is in ``dtype``
    captured: list[tuple[Tensor, Tensor]] = []
    original = block.accumulate

    def spy(inputs: Tensor, grad_output: Tensor) -> None:
        captured.append((inputs, grad_output))
        original(inputs, grad_output)

    block.accumulate = spy
    x, y = amp_batch(0)
    with torch.autocast("cpu", dtype=dtype):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    (inputs, grad_output), = captured
    assert inputs.dtype is dtype and grad_output.dtype is dtype
    a = torch.cat([inputs.float(), torch.ones(len(inputs), 1)], dim=1)
    g = grad_output.float()
    assert block.A.pending.dtype is block.G.pending.dtype is torch.float32
    torch.testing.assert_close(block.A.pending, a.T @ a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(block.G.pending, g.T @ g, rtol=1e-6, atol=1e-12)


def test_the_deprecated_torch_cuda_amp_grad_scaler_is_accepted() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated; disabled without CUDA
        scaler = torch.cuda.amp.GradScaler()
    model, optimizer, _ = amp_run(2, dtype=None, init_scale=None, make_optimizer=KFAC)
    reference = copy.deepcopy(model)
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS},
                     runtime=RuntimeConfig(grad_scaler=scaler))
    for step in range(2):  # a disabled scaler: scale(), step() and the statistics are plain
        x, y = amp_batch(step)
        optimizer.zero_grad()
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.step(optimizer)
    control = KFAC(reference, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    for step in range(2):
        x, y = amp_batch(step)
        control.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        control.step()
    torch.testing.assert_close(params(model), params(reference), rtol=0, atol=0)


# -- DDP + GradScaler on 2 gloo ranks -------------------------------------------------------------

WORLD = 2
DDP_STEPS = 4


def ddp_with_grad_scaler(rank: int, world: int, directory: Path) -> dict[str, Any]:
    model = make_amp_net()
    ddp = DDP(model)
    optimizer = KFAC(ddp, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    scaler = torch.amp.GradScaler("cpu")
    size = BATCH // world
    for step in range(DDP_STEPS):
        x, y = amp_batch(step)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(ddp(x[rank * size : (rank + 1) * size]), y[rank * size : (rank + 1) * size])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.synchronize_factors()
    return {"params": params(model), "factors": running_factors(optimizer), "steps": optimizer.steps}


def amp_run_over_rank_shards(steps: int, world: int) -> tuple[nn.Module, KFAC]:
    """One process on the whole batch, accumulating the ``world`` ranks' shards as DDP reduces them.

    DDP's gradient is ``Σ_r g_r / world`` (each rank's mean-loss gradient, divided by the world size
    and summed); ``(loss_r / world).backward()`` per shard gives the same sum bit for bit (halving is
    exact), so the parameters of both runs agree exactly and fp16 autocast rounds the same layer
    inputs in both. One backward on the whole batch sums in another order: a last-bit difference
    in the parameters flips fp16 roundings of ``fc1``'s input on some machines' kernels and moves
    ``A`` by about 1e-4 of its entries (and the parameters by 1e-4 after 4 steps), which says nothing
    about K-FAC's distributed statistics.
    """
    model = make_amp_net()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **OPTIONS})
    scaler = torch.amp.GradScaler("cpu")
    for step in range(steps):
        x, y = amp_batch(step)
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(world), y.chunk(world)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(xs), ys) / world
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return model, optimizer


def test_ddp_with_grad_scaler_on_two_gloo_ranks_matches_one_process_on_the_whole_batch(tmp_path: Path) -> None:
    result = spawn(ddp_with_grad_scaler, WORLD, tmp_path, deadline_s=120.0)[0]
    model, optimizer = amp_run_over_rank_shards(DDP_STEPS, WORLD)
    assert result["steps"] == optimizer.steps == DDP_STEPS
    torch.testing.assert_close(result["factors"], running_factors(optimizer), rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(result["params"], params(model), rtol=1e-3, atol=1e-4)
