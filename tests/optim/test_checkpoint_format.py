"""The ``"kfac"`` checkpoint entry holds nothing redundant (docs/design.md §5).

Dense running factors are saved packed (their upper triangle) and decompositions at their capped
rank, so the entry's size is bounded by what the layer shapes say; an entry of another format (or
none: earlier releases) is refused naming it.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded_batch
from torch import nn

from kfac_optim import KFAC
from kfac_optim.checkpoint import FORMAT
from kfac_optim.methods import Eigen
from tests.distributed.test_distributed import ddp_train, make_ddp_net
from tests.integration.test_feeding import TinyLM, lm_batch, lm_loss

WIDTHS = (400, 300, 10)  # Linear(400, 300), Linear(300, 10): A 401 and 301, G 300 and 10
MAX_RANK = Eigen().max_rank  # the default eigenbasis cap
FORMAT_SETTINGS = dict(lr=0.05, damping=0.1, factor_update_steps=1, decomposition_update_steps=2)


def wide_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTHS[0], WIDTHS[1]), nn.Tanh(), nn.Linear(WIDTHS[1], WIDTHS[2]))


def train_wide_mlp(model: nn.Module, optimizer: KFAC, steps: range) -> None:
    for step in steps:
        x, y = seeded_batch((256, WIDTHS[0]), WIDTHS[2], seed=step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def serialized_bytes(value: object) -> int:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getbuffer().nbytes


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_kfac_entry_is_at_most_packed_factors_plus_capped_decompositions(method: str) -> None:
    """Bound from the shapes alone (fp32): per factor of dimension n, its upper triangle
    n(n+1)/2 and an eigenbasis of at most min(n, cap) columns (Q, d and σ), or for the damped
    inverse another triangle; plus 4 KiB of serialization per factor. Saving factors (and
    inverses) whole would exceed it by ~n²/2 per factor."""
    model = wide_mlp()
    optimizer = KFAC(model, **FORMAT_SETTINGS, method=method)
    train_wide_mlp(model, optimizer, range(3))  # steps 0 and 2 decompose: every factor holds one
    assert all(f.decomposition is not None for b in optimizer.blocks for f in b.factors.values())
    dims = [WIDTHS[0] + 1, WIDTHS[1], WIDTHS[1] + 1, WIDTHS[2]]
    assert sorted(f.dim for b in optimizer.blocks for f in b.factors.values()) == sorted(dims)
    itemsize = 4
    packed = sum(n * (n + 1) // 2 for n in dims) * itemsize
    if method == "eigen":
        decompositions = sum(n * min(n, MAX_RANK) + min(n, MAX_RANK) + 1 for n in dims) * itemsize
    else:
        decompositions = packed
    entry = serialized_bytes(optimizer.state_dict()["kfac"])
    assert entry <= packed + decompositions + 4096 * len(dims), (entry, packed, decompositions)


def test_packed_entry_round_trips_bit_identically_between_decompositions() -> None:
    """Saved after a factor step (the decompositions then are of older factors), loaded into a
    fresh optimizer: the same factors, bit for bit, and the same parameters two steps on."""
    model = wide_mlp()
    optimizer = KFAC(model, **FORMAT_SETTINGS)
    train_wide_mlp(model, optimizer, range(4))  # step 3 folds only
    state = optimizer.state_dict()
    assert state["kfac"]["format"] == FORMAT
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    resumed_model = wide_mlp()
    resumed_model.load_state_dict(model_state)
    resumed = KFAC(resumed_model, **FORMAT_SETTINGS)
    resumed.load_state_dict(state)
    for block, other in zip(optimizer.blocks, resumed.blocks, strict=True):
        for name, factor in block.factors.items():
            assert torch.equal(factor.running, other.factors[name].running), (block.name, name)
    train_wide_mlp(model, optimizer, range(4, 6))
    train_wide_mlp(resumed_model, resumed, range(4, 6))
    for (name, p), q in zip(model.named_parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize(("edit", "match"), [
    (lambda entry: entry.update(format=3), "'format' 3 is not one this release reads"),
    (lambda entry: entry.pop("format"), "has no 'format': saved by an earlier release"),
])
def test_an_unknown_or_missing_format_is_refused_and_nothing_changes(edit, match: str) -> None:
    model = wide_mlp()
    optimizer = KFAC(model, **FORMAT_SETTINGS)
    train_wide_mlp(model, optimizer, range(3))
    state = optimizer.state_dict()
    state["kfac"] = dict(state["kfac"])
    edit(state["kfac"])
    fresh = KFAC(wide_mlp(), **FORMAT_SETTINGS)
    with pytest.raises(ValueError, match=match):
        fresh.load_state_dict(state)
    assert fresh.steps == 0 and not any(bool(f.initialized) for b in fresh.blocks for f in b.factors.values())


@pytest.mark.parametrize(("tied", "method"), [(False, "eigen"), (False, "inverse"), (True, "eigen")])
def test_every_factor_kind_unpacks_bit_identically(tied: bool, method: str) -> None:
    """Grouped and depthwise convs (batched factors), attention, an embedding's diagonal, a Conv3d,
    and a tied embedding/head's use factors and derived ones: saved packed (running factors, and
    the damped inverses of ``method="inverse"``), loaded whole, bit for bit."""
    model = TinyLM(vocab=13, width=8, tied=True) if tied else make_ddp_net(modern=True)
    settings = {**FORMAT_SETTINGS, "factor_update_steps": 1, "decomposition_update_steps": 10, "method": method}
    optimizer = KFAC(model, **settings)
    if tied:
        for step in range(3):
            optimizer.zero_grad()
            lm_loss(model, *lm_batch(step, n=4, vocab=13)).backward()
            optimizer.step()
    else:
        ddp_train(model, optimizer, range(3))
    fresh_model = TinyLM(vocab=13, width=8, tied=True) if tied else make_ddp_net(modern=True)
    fresh = KFAC(fresh_model, **settings)
    fresh.load_state_dict(optimizer.state_dict())

    def every_factor(kfac: KFAC) -> dict[str, torch.Tensor]:
        found = {}
        for block in kfac.blocks:
            uses = block.head.factors() if getattr(block, "head", None) is not None else {}
            for name, factor in {**block.factors, **uses}.items():
                found[f"{block.name}.{name}"] = factor.running
                decomposition = factor.decomposition
                if isinstance(decomposition, torch.Tensor):
                    found[f"{block.name}.{name} inverse"] = decomposition
                elif decomposition is not None:
                    found[f"{block.name}.{name} Q"] = decomposition.Q
        return found

    saved, loaded = every_factor(optimizer), every_factor(fresh)
    assert saved.keys() == loaded.keys() and len(saved) >= (6 if tied else 24)
    for key, tensor in saved.items():
        assert torch.equal(tensor, loaded[key]), key
