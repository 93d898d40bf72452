"""K-FAC's checkpoint state is a tree of owners (``kfac_optim.state``), composed as ``nn.Module`` composes
``state_dict``: each owner saves, checks and loads its own part, its children's under their keys.

An owner defined here, added to the estimator's children, travels through ``state_dict()``,
``load_state_dict()`` and the DCP view without a line of ``checkpoint.py`` knowing it; the saved
entry's keys are the owner tree's; an error names the keys down to the misfit.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC
from kfac_optim.state import StateError, within

TREE_SETTINGS = dict(lr=0.1, momentum=0.9, factor_update_steps=1, decomposition_update_steps=2)


class TallyOwner:
    """A new owner of checkpoint state: a tally kept as a tensor, which must be finite and >= 0."""

    def __init__(self) -> None:
        self.tally = torch.zeros(())

    def state_dict(self) -> dict[str, Any]:
        return {"tally": self.tally.clone()}

    def check_state(self, state: Any) -> None:
        if state is None:
            return  # saved before this owner existed: nothing to restore
        if not isinstance(state, dict) or not isinstance(state.get("tally"), torch.Tensor):
            raise ValueError("expected a dict with a tensor 'tally'")
        if not torch.isfinite(state["tally"]) or state["tally"] < 0:
            raise ValueError(f"'tally' must be finite and >= 0, got {state['tally'].item()}")

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.tally = torch.zeros(()) if state is None else state["tally"].clone()


def tree_optimizer(steps: int) -> tuple[nn.Module, KFAC]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    optimizer = KFAC(model, **TREE_SETTINGS)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 5, generator=generator), torch.randint(0, 3, (4,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model, optimizer


def with_tally(optimizer: KFAC, value: float) -> TallyOwner:
    owner = TallyOwner()
    owner.tally.fill_(value)
    optimizer.estimator.state_children["tally"] = owner
    return owner


def test_an_owner_added_to_the_tree_saves_and_restores_without_checkpoint_py_knowing_it() -> None:
    _, source = tree_optimizer(steps=3)
    with_tally(source, 7.0)
    state = source.state_dict()
    assert torch.equal(state["kfac"]["tally"]["tally"], torch.tensor(7.0))
    _, target = tree_optimizer(steps=0)
    owner = with_tally(target, 0.0)
    target.load_state_dict(state)
    assert owner.tally == 7.0
    assert target.steps == 3
    for block, loaded in zip(source.blocks, target.blocks, strict=True):
        assert torch.equal(block.A.running, loaded.A.running) and torch.equal(block.G.running, loaded.G.running)
    # through the DCP view too (its state_dict is a collective only under torch.distributed)
    _, dcp_target = tree_optimizer(steps=0)
    dcp_owner = with_tally(dcp_target, 0.0)
    dcp_target.kfac_state().load_state_dict(copy.deepcopy(source.kfac_state().state_dict()))
    assert dcp_owner.tally == 7.0 and dcp_target.steps == 3


def test_a_misfit_in_the_new_owner_names_its_key_and_changes_nothing() -> None:
    _, source = tree_optimizer(steps=3)
    with_tally(source, -1.0)
    state = source.state_dict()
    _, target = tree_optimizer(steps=1)
    owner = with_tally(target, 2.0)
    before = [f.running.clone() for b in target.blocks for f in b.factors.values()]
    with pytest.raises(ValueError, match=r"^K-FAC checkpoint, 'tally': 'tally' must be finite and >= 0, got -1\.0$"):
        target.load_state_dict(state)
    assert owner.tally == 2.0 and target.steps == 1
    assert all(torch.equal(a, f.running) for a, f in zip(before, (f for b in target.blocks for f in b.factors.values()),
                                                        strict=True))


def test_the_saved_entry_has_the_keys_of_the_owner_tree() -> None:
    _, optimizer = tree_optimizer(steps=3)
    entry = optimizer.state_dict()["kfac"]
    estimator = optimizer.estimator
    assert set(entry) == {"format", "steps", "intervals", "round", *estimator.state_children}
    assert set(estimator.state_children) == {"blocks", "damping", "stagger"}
    assert list(entry["blocks"]) == [block.name for block in optimizer.blocks]
    for block in optimizer.blocks:
        assert set(entry["blocks"][block.name]["factors"]) == set(block.factors)


def test_an_error_deep_in_the_tree_names_every_key_down_to_it() -> None:
    _, source = tree_optimizer(steps=3)
    state = source.state_dict()
    state["kfac"]["blocks"]["2"]["factors"]["G"]["running"] = torch.zeros(2)
    _, target = tree_optimizer(steps=1)
    misfit = r"^K-FAC checkpoint, 'blocks', layer '2', factor G: 'running' has shape \(2,\)"
    with pytest.raises(ValueError, match=misfit):
        target.load_state_dict(state)


def test_within_puts_each_owner_label_in_front_of_the_reason() -> None:
    with pytest.raises(StateError) as caught, within("outer"), within("inner"):
        raise ValueError("why")
    assert str(caught.value) == "outer, inner: why"
    assert caught.value.path == ("outer", "inner") and caught.value.reason == "why"
