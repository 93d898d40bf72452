"""Bad input gets a clear error naming the argument; faults are survived with a warning (docs/design.md §7)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"lr": -0.1}, "lr"),
        ({"momentum": -0.5}, "momentum"),
        ({"weight_decay": -1e-4}, "weight_decay"),
        ({"nesterov": True}, "nesterov"),
        ({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, "nesterov"),
        ({"damping": 0.0}, "damping"),
        ({"damping": -1.0}, "damping"),
        ({"factor_decay": 1.0}, "factor_decay"),
        ({"factor_decay": -0.1}, "factor_decay"),
        ({"kl_clip": 0.0}, "kl_clip"),
        ({"factor_update_steps": 0}, "factor_update_steps"),
        ({"inv_update_steps": 0}, "inv_update_steps"),
        ({"inv_update_steps": 2.5}, "inv_update_steps"),
        ({"method": "cholesky"}, "method"),
        ({"loss_reduction": "none"}, "loss_reduction"),
        ({"factor_dtype": torch.float16}, "factor_dtype"),
        ({"inv_dtype": torch.bfloat16}, "inv_dtype"),
        ({"params": [nn.Parameter(torch.zeros(2))]}, "params"),
    ],
)
def test_bad_argument_raises_value_error_naming_it(kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        KFAC(model(), **{"lr": 0.1, **kwargs})


def test_model_must_be_a_module() -> None:
    with pytest.raises(TypeError, match="model"):
        KFAC([nn.Parameter(torch.zeros(2))], lr=0.1)


def test_skip_layers_must_be_a_sequence() -> None:
    with pytest.raises(TypeError, match="skip_layers"):
        KFAC(model(), lr=0.1, skip_layers="0")


def test_schedule_returning_a_bad_value_is_named_when_used() -> None:
    optimizer = KFAC(model(), lr=0.1, damping=lambda step: -1.0)
    with pytest.raises(ValueError, match="damping"):
        optimizer.step()


def test_a_layer_its_block_declines_warns_once_and_takes_the_sgd_path() -> None:
    """A sparse-gradient embedding is of a registered kind that its block does not support."""
    net = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="sparse") as record:
        optimizer = KFAC(net, lr=0.1)
    assert len([w for w in record if "sparse" in str(w.message)]) == 1
    assert {w.filename for w in record} == {__file__}  # the warning names the user's line
    assert [b.name for b in optimizer.blocks] == ["1"]
    (report,) = [r for r in optimizer.module_reports if r.name == "0"]
    assert report.block is None and report.status == "unsupported" and "sparse" in report.detail


def train_step(net: nn.Module, optimizer: KFAC, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 4, generator=generator), torch.randint(0, 3, (16,), generator=generator)
    optimizer.zero_grad()
    F.cross_entropy(net(x), y).backward()
    optimizer.step()


def test_non_finite_statistics_are_discarded_with_a_warning() -> None:
    net = model()
    optimizer = KFAC(net, lr=0.1, inv_update_steps=2)
    train_step(net, optimizer)
    before = optimizer.blocks[0].A.running.clone()
    optimizer.zero_grad()
    x = torch.randn(16, 4)
    F.cross_entropy(net(x), torch.zeros(16, dtype=torch.long)).backward()
    optimizer.blocks[0].A.pending[0, 0] = float("nan")  # a corrupted batch of statistics
    optimizer.step()  # step 1: factor step, not a decomposition step
    assert torch.equal(optimizer.blocks[0].A.running, before)
    with pytest.warns(RuntimeWarning, match=r"layer '0'.*non-finite.*A statistics discarded"):
        train_step(net, optimizer, seed=2)  # step 2: the decomposition step reports it
    assert torch.isfinite(optimizer.blocks[0].A.running).all()


def test_first_fold_non_finite_leaves_factor_uninitialized() -> None:
    net = model()
    optimizer = KFAC(net, lr=0.1)
    x = torch.randn(8, 4)
    F.cross_entropy(net(x), torch.zeros(8, dtype=torch.long)).backward()
    optimizer.blocks[1].G.pending.fill_(float("inf"))
    with pytest.warns(RuntimeWarning, match="layer '2'"):
        optimizer.step()
    block = optimizer.blocks[1]
    assert not block.G.initialized and block.G.decomposition is None  # that layer took the SGD path
    train_step(net, optimizer, seed=1)
    assert block.G.initialized and torch.isfinite(block.G.running).all()


def test_failed_decomposition_keeps_the_last_good_one(monkeypatch: pytest.MonkeyPatch) -> None:
    net = model()
    optimizer = KFAC(net, lr=0.1, inv_update_steps=1)
    train_step(net, optimizer)
    good = optimizer.blocks[0].A.decomposition

    def failing_eigh(matrix: torch.Tensor, *args, **kwargs):
        raise torch.linalg.LinAlgError("forced failure")

    monkeypatch.setattr(torch.linalg, "eigh", failing_eigh)
    with pytest.warns(RuntimeWarning, match="decomposition of [AG] failed, float64 retry included.*last good decomposition is kept") as record:
        train_step(net, optimizer, seed=1)
    # Raised inside step() behind torch.optim's wrappers, attributed to the caller of step().
    assert {w.filename for w in record} == {__file__}
    assert len(record) == 2 * len(optimizer.blocks)  # one warning per failed factor
    assert optimizer.blocks[0].A.decomposition is good
    assert optimizer.blocks[0].failures == 2  # A and G
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_float32_failure_is_retried_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    net = model()
    optimizer = KFAC(net, lr=0.1, inv_update_steps=1)
    real_eigh = torch.linalg.eigh

    def float32_fails(matrix: torch.Tensor, *args, **kwargs):
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("forced float32 failure")
        return real_eigh(matrix, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", float32_fails)
    train_step(net, optimizer)
    decomposition = optimizer.blocks[0].A.decomposition
    assert decomposition is not None and decomposition.Q.dtype == torch.float32
    assert optimizer.blocks[0].failures == 0
