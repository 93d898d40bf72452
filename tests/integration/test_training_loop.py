"""Training-loop contracts: accumulation, capture rules, hooks, checkpoints, schedules."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from helpers import running_factors, seeded_batch
from torch import nn
from torch.utils.checkpoint import checkpoint

from kfac_optim import KFAC, MilestoneSchedule


class CapturePathsNet(nn.Module):
    """Conv → in-place ReLU → Linear over a (N, T, features) view: every capture path at once."""

    def __init__(self, inplace: bool = True, checkpoint_mode: str | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.act = nn.ReLU(inplace=inplace)
        self.seq = nn.Linear(6, 4)
        self.head = nn.Linear(4 * 3 * 6, 5)
        self.checkpoint_mode = checkpoint_mode

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_mode is None:
            h = self.body(x)
        else:
            h = checkpoint(self.body, x, use_reentrant=self.checkpoint_mode == "reentrant")
        h = self.seq(h.reshape(len(x), 18, 6))  # Linear with a leading dim
        return self.head(h.flatten(1))


def loop_batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_batch((n, 1, 6, 6), 5, seed=seed)




def assert_same_factors(a: KFAC, b: KFAC, **tolerance) -> None:
    fa, fb = running_factors(a), running_factors(b)
    assert fa.keys() == fb.keys()
    for key in fa:
        torch.testing.assert_close(fa[key], fb[key], **tolerance, msg=key)


def test_accumulated_micro_batches_equal_one_large_batch() -> None:
    torch.manual_seed(0)
    model = CapturePathsNet()
    accumulated = copy.deepcopy(model)
    x, y = loop_batch(12)
    opt_one = KFAC(model, lr=0.1, damping=0.1, factor_update_steps=1, decomposition_update_steps=10)
    F.cross_entropy(model(x), y).backward()
    opt_one.step()

    opt_acc = KFAC(accumulated, lr=0.1, damping=0.1, factor_update_steps=1, decomposition_update_steps=10)
    for xs, ys in zip(x.split([4, 8]), y.split([4, 8])):  # unequal micro-batches, loss weighted by size
        (F.cross_entropy(accumulated(xs), ys) * len(xs) / 12).backward()
    opt_acc.step()

    assert_same_factors(opt_one, opt_acc, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), accumulated.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_does_not_double_count(mode: str) -> None:
    plain, checkpointed = CapturePathsNet(), CapturePathsNet(checkpoint_mode=mode)
    checkpointed.load_state_dict(plain.state_dict())
    optimizers = [KFAC(m, lr=0.1, factor_update_steps=1, decomposition_update_steps=10) for m in (plain, checkpointed)]
    x, y = loop_batch(8)
    x.requires_grad_(mode == "reentrant")  # reentrant checkpoint needs an input that requires grad
    for model, optimizer in zip((plain, checkpointed), optimizers):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert_same_factors(*optimizers, rtol=1e-6, atol=1e-7)
    assert all(b.pending_samples == 0 for o in optimizers for b in o.blocks)


def test_inplace_relu_after_a_layer_sees_the_layers_own_output_gradient() -> None:
    inplace, out_of_place = CapturePathsNet(inplace=True), CapturePathsNet(inplace=False)
    out_of_place.load_state_dict(inplace.state_dict())
    optimizers = [KFAC(m, lr=0.1, factor_update_steps=1, decomposition_update_steps=10) for m in (inplace,
                                                                                                  out_of_place)]
    x, y = loop_batch(8)
    for model, optimizer in zip((inplace, out_of_place), optimizers):
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert_same_factors(*optimizers, rtol=0, atol=0)


def test_no_statistics_under_no_grad_or_between_factor_steps() -> None:
    """(Eval mode records: tests/integration/test_loops_capture.py.)"""
    model = CapturePathsNet()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=2, decomposition_update_steps=10)
    x, y = loop_batch(4)
    model.eval()
    with torch.no_grad():
        model(x)
    model.train()
    with torch.no_grad():
        model(x)
    assert all(b.pending_samples == 0 for b in optimizer.blocks)
    optimizer.step()  # step 0 is a factor step; the statistics were empty
    assert all(b.A.version == 0 for b in optimizer.blocks)
    F.cross_entropy(model(x), y).backward()  # step 1: hooks disarmed
    assert all(b.pending_samples == 0 for b in optimizer.blocks)


def test_remove_hooks_lets_a_second_optimizer_own_the_model() -> None:
    model = CapturePathsNet()
    first = KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    first.remove_hooks()
    second = KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    x, y = loop_batch(4)
    F.cross_entropy(model(x), y).backward()
    assert all(b.pending_samples == 0 for b in first.blocks)
    assert all(b.pending_samples == 4 for b in second.blocks)


def test_zero_grad_drops_statistics_of_a_step_that_never_happened() -> None:
    model = CapturePathsNet()
    optimizer = KFAC(model, lr=0.1, damping=0.1, factor_update_steps=1, decomposition_update_steps=10)
    reference = copy.deepcopy(model)
    reference_optimizer = KFAC(reference, lr=0.1, damping=0.1, factor_update_steps=1, decomposition_update_steps=10)
    x_skipped, y_skipped = loop_batch(4, seed=1)
    F.cross_entropy(model(x_skipped), y_skipped).backward()  # e.g. a NaN loss the user skips
    optimizer.zero_grad()
    x, y = loop_batch(4)
    for m, opt in ((model, optimizer), (reference, reference_optimizer)):
        F.cross_entropy(m(x), y).backward()
        opt.step()
    assert_same_factors(optimizer, reference_optimizer, rtol=0, atol=0)


def test_steps_without_statistics_do_not_touch_the_pending_buffers() -> None:
    """Non-factor steps and zero_grad cost no pass over the (n, n) pending statistics."""
    model = CapturePathsNet()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=2, decomposition_update_steps=2)
    x, y = loop_batch(4)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()  # step 0: a factor step folds (and clears) the statistics
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()  # step 1: hooks disarmed
    pending_shapes = {(f.dim, f.dim) for b in optimizer.blocks for f in b.factors.values()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        optimizer.step()
        optimizer.zero_grad()
    fills = [tuple(e.input_shapes[0]) for e in profile.events() if e.name in ("aten::zero_", "aten::fill_")]
    assert not pending_shapes & set(fills), fills
    assert all(not f.pending.any() for b in optimizer.blocks for f in b.factors.values())


def test_update_intervals_follow_their_schedules() -> None:
    model = CapturePathsNet()
    optimizer = KFAC(
        model,
        lr=0.01,
        factor_update_steps=MilestoneSchedule(1, milestones=(3,), gamma=2),
        decomposition_update_steps=lambda step: 2,
    )
    folds, decompositions = [], []
    for step in range(6):
        x, y = loop_batch(4, seed=step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        versions = optimizer.blocks[0].A.version
        optimizer.step()
        folds.append(optimizer.blocks[0].A.version - versions)
        decompositions.append(optimizer.blocks[0].A.decomposed_key[0])
    assert folds == [1, 1, 1, 0, 1, 0]  # every step, then every 2nd from step 3 on
    assert decompositions == [1, 1, 3, 3, 4, 4]  # refreshed at steps 0, 2, 4 (factor versions)


def loop_run(model: nn.Module, optimizer: KFAC, steps: range) -> None:
    for step in steps:
        x, y = loop_batch(8, seed=step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_state_dict_round_trip_resumes_bit_identically(method: str) -> None:
    settings = dict(lr=0.05, momentum=0.9, weight_decay=1e-4, damping=0.05, factor_update_steps=2,
                    decomposition_update_steps=3, method=method)
    model = CapturePathsNet()
    optimizer = KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **settings})
    loop_run(model, optimizer, range(5))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    loop_run(model, optimizer, range(5, 10))

    buffer.seek(0)
    checkpoint_ = torch.load(buffer, weights_only=True)
    resumed = CapturePathsNet()
    resumed.load_state_dict(checkpoint_["model"])
    resumed_optimizer = KFAC(resumed, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **settings})
    resumed_optimizer.load_state_dict(checkpoint_["optimizer"])
    assert resumed_optimizer.steps == 5
    loop_run(resumed, resumed_optimizer, range(5, 10))
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_checkpoint_keys_factors_by_module_name() -> None:
    optimizer = KFAC(CapturePathsNet(), lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
    assert set(optimizer.state_dict()["kfac"]["blocks"]) == {"conv", "seq", "head"}
