"""Bad input gets a clear error naming the argument; faults are survived with a warning (docs/design.md §7)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, CurvatureConfig, RuntimeConfig, UpdateConfig
from kfac_optim.schedule.intervals import AutoIntervals

# -- the validation table: KFAC(**kwargs) with one bad argument ---------------------------------
#
# One row per bad input: (constructor keywords, exception type, regex the message must match: the
# argument's name at least). The keywords are merged over ``BASE`` (a model and ``lr``), so a row
# names only what it tests, and re-pointing a row to a new spelling (e.g. a keyword that moves into a
# config dataclass) is a change of that row alone.


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def bad(kwargs: dict[str, Any], error: type[Exception], match: str, id: str | None = None) -> Any:  # noqa: A002
    """One table row, its test id the keywords (or ``id``)."""
    return pytest.param(kwargs, error, match, id=id or ", ".join(f"{k}={v!r}" for k, v in kwargs.items()))


class Later:
    """A row's config built inside the test (its constructor is what raises): ``Later(Config, **fields)``."""

    def __init__(self, make: Callable[..., Any], **fields: Any) -> None:
        self.make, self.fields = make, fields

    def __repr__(self) -> str:
        return f"{self.make.__name__}({', '.join(f'{k}={v!r}' for k, v in self.fields.items())})"


BASE: dict[str, Any] = {"lr": 0.1}
"""What every row's constructor call gets besides its own keywords (the model is built per call)."""

VALIDATION_TABLE = [
    # the model and the parameters
    bad({"model": [nn.Parameter(torch.zeros(2))]}, TypeError, "model", id="model=list of parameters"),
    # (params outside the model are accepted: they take the SGD path, tests/integration/test_feeding.py)
    # SGD's own arguments
    bad({"lr": -0.1}, ValueError, "lr"),
    bad({"lr": float("nan")}, ValueError, "lr"),
    bad({"lr": "0.1"}, TypeError, "lr"),
    bad({"momentum": -0.5}, ValueError, "momentum"),
    bad({"momentum": float("nan")}, ValueError, "momentum"),
    bad({"weight_decay": -1e-4}, ValueError, "weight_decay"),
    bad({"weight_decay": float("inf")}, ValueError, "weight_decay"),
    bad({"dampening": float("nan")}, ValueError, "dampening"),
    bad({"nesterov": True}, ValueError, "nesterov"),
    bad({"nesterov": True, "momentum": 0.9, "dampening": 0.1}, ValueError, "nesterov"),
    # the everyday K-FAC arguments
    bad({"damping": 0.0}, ValueError, "damping"),
    bad({"damping": -1.0}, ValueError, "damping"),
    bad({"damping": float("inf")}, ValueError, "damping"),
    bad({"damping": float("nan")}, ValueError, "damping"),
    bad({"kl_clip": 0.0}, ValueError, "kl_clip"),
    bad({"kl_clip": float("inf")}, ValueError, "kl_clip"),
    bad({"kl_clip": float("nan")}, ValueError, "kl_clip"),
    bad({"factor_update_steps": 0}, ValueError, "factor_update_steps"),
    bad({"factor_update_steps": True}, ValueError, "factor_update_steps"),
    bad({"decomposition_update_steps": 0}, ValueError, "decomposition_update_steps"),
    bad({"decomposition_update_steps": 2.5}, ValueError, "decomposition_update_steps"),
    bad({"method": "cholesky"}, ValueError, "method"),
    bad({"factor_update_steps": "fast"}, ValueError, "factor_update_steps.*'auto'"),
    bad({"decomposition_update_steps": "automatic"}, ValueError, "decomposition_update_steps.*'auto'"),
    bad({"factor_update_steps": AutoIntervals(overhead=1.0), "decomposition_update_steps": AutoIntervals()}, ValueError,
        "factor_update_steps=.*decomposition_update_steps=.*same AutoIntervals", id="two different AutoIntervals"),
    bad({"curvature": Later(CurvatureConfig, stagger=True), "factor_update_steps": "auto"}, ValueError,
        "stagger.*explicit factor_update_steps",
        id="stagger with auto intervals"),
    # the advanced ones
    bad({"curvature": Later(CurvatureConfig, factor_decay=1.0)}, ValueError, "factor_decay"),
    bad({"curvature": Later(CurvatureConfig, factor_decay=-0.1)}, ValueError, "factor_decay"),
    bad({"curvature": Later(CurvatureConfig, loss_reduction="none")}, ValueError, "loss_reduction"),
    bad({"curvature": Later(CurvatureConfig, weight_sharing="sum")}, ValueError, "weight_sharing"),
    bad({"curvature": Later(CurvatureConfig, skip_layers="0")}, TypeError, "skip_layers"),
    bad({"curvature": Later(CurvatureConfig, skip_layers=None)}, TypeError, "skip_layers"),
    bad({"curvature": Later(CurvatureConfig, skip_layers=[5])}, TypeError, "skip_layers"),
    bad({"curvature": Later(CurvatureConfig, skip_layers=["("])}, ValueError, "skip_layers"),
    bad({"curvature": Later(CurvatureConfig, factor_dtype=torch.float16)}, ValueError, "factor_dtype"),
    bad({"curvature": Later(CurvatureConfig, inv_dtype=torch.bfloat16)}, ValueError, "inv_dtype"),
    bad({"runtime": Later(RuntimeConfig, grad_worker_fraction=1.5)}, ValueError, "grad_worker_fraction"),
    bad({"runtime": Later(RuntimeConfig, grad_worker_fraction="fastest")}, ValueError, "grad_worker_fraction"),
    bad({"runtime": Later(RuntimeConfig, grad_scaler=object())}, TypeError, "grad_scaler",
        id="runtime=RuntimeConfig(grad_scaler=object())"),  # an id without the object's address
    bad({"runtime": Later(RuntimeConfig, async_statistics=1)}, TypeError, "async_statistics.* must be a bool"),
    bad({"curvature": Later(CurvatureConfig, stagger=1)}, TypeError, "stagger_factor_updates"),
    # the update rule
    bad({"update": {"grafting": "adam"}}, TypeError, "update", id="update=dict"),
    bad({"update": Later(UpdateConfig, trust_region="peak")}, ValueError, "trust_region"),
    bad({"update": Later(UpdateConfig, grafting="lamb")}, ValueError, "grafting"),
    bad({"update": Later(UpdateConfig, decoupled_weight_decay=1)}, TypeError, "decoupled_weight_decay"),
    bad({"update": Later(UpdateConfig, grafting="adam", adam_betas=(0.9, 1.0))}, ValueError, "adam_betas"),
    bad({"update": Later(UpdateConfig, grafting="adam", adam_eps=0.0)}, ValueError, "adam_eps"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), VALIDATION_TABLE)
def test_bad_argument_raises_an_error_naming_it(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        built = {name: value.make(**value.fields) if isinstance(value, Later) else value
                 for name, value in kwargs.items()}
        KFAC(**{"factor_update_steps": 1, "decomposition_update_steps": 10, **{"model": small_mlp(), **BASE, **built}})


def test_schedule_returning_a_bad_value_is_named_when_used() -> None:
    optimizer = KFAC(small_mlp(), lr=0.1, damping=lambda step: -1.0, factor_update_steps=1,
                     decomposition_update_steps=10)
    with pytest.raises(ValueError, match="damping"):
        optimizer.step()


def test_a_layer_its_block_declines_warns_once_and_takes_the_sgd_path() -> None:
    """A sparse-gradient embedding is of a registered kind that its block does not support."""
    net = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.warns(UserWarning, match="sparse") as record:
        optimizer = KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
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
    net = small_mlp()
    optimizer = KFAC(net, lr=0.1, decomposition_update_steps=2, factor_update_steps=1)
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
    net = small_mlp()
    optimizer = KFAC(net, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)
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
    net = small_mlp()
    optimizer = KFAC(net, lr=0.1, decomposition_update_steps=1, factor_update_steps=1)
    train_step(net, optimizer)
    good = optimizer.blocks[0].A.decomposition

    def failing_eigh(matrix: torch.Tensor, *args, **kwargs):
        raise torch.linalg.LinAlgError("forced failure")

    monkeypatch.setattr(torch.linalg, "eigh", failing_eigh)
    with pytest.warns(RuntimeWarning,
                      match="decomposition of [AG] failed, float64 retry included.*last good "
                            "decomposition is kept") as record:
        train_step(net, optimizer, seed=1)
    # Raised inside step() behind torch.optim's wrappers, attributed to the caller of step().
    assert {w.filename for w in record} == {__file__}
    assert len(record) == 2 * len(optimizer.blocks)  # one warning per failed factor
    assert optimizer.blocks[0].A.decomposition is good
    assert optimizer.blocks[0].failures == 2  # A and G
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_float32_failure_is_retried_in_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    net = small_mlp()
    optimizer = KFAC(net, lr=0.1, decomposition_update_steps=1, factor_update_steps=1)
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
