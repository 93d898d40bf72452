"""State-dict hooks and old SGD checkpoints (docs/api.md "state_dict()").

- A user's ``register_state_dict_post_hook`` sees the whole state, K-FAC's ``"kfac"`` entry included.
- A user's ``register_load_state_dict_pre_hook`` runs before K-FAC checks the ``"kfac"`` entry, so it
  can repair (e.g. rename the layers of) a checkpoint that K-FAC would otherwise reject.
- A state dict saved by ``torch.optim.SGD`` on an older torch, whose param groups lack ``maximize``
  and ``foreach``, loads and steps as it does under SGD (``__setstate__`` defaults).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC


def _trained() -> tuple[nn.Module, KFAC]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    optimizer = KFAC(model, lr=0.1, momentum=0.9, decomposition_update_steps=1, factor_update_steps=1)
    for _ in range(2):
        optimizer.zero_grad()
        F.cross_entropy(model(torch.randn(6, 4)), torch.randint(0, 2, (6,))).backward()
        optimizer.step()
    return model, optimizer


def test_a_state_dict_post_hook_sees_the_kfac_entry() -> None:
    _, optimizer = _trained()
    seen: dict[str, Any] = {}

    def post_hook(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        seen.update(state_dict)

    optimizer.register_state_dict_post_hook(post_hook)
    state = optimizer.state_dict()
    assert "kfac" in seen and seen["kfac"]["steps"] == 2
    assert set(seen) == set(state)


def test_a_state_dict_post_hook_may_replace_the_kfac_entry() -> None:
    _, optimizer = _trained()

    def post_hook(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {**state_dict, "kfac": {**state_dict["kfac"], "steps": 7}}

    optimizer.register_state_dict_post_hook(post_hook)
    assert optimizer.state_dict()["kfac"]["steps"] == 7


def test_a_load_pre_hook_runs_before_kfac_checks_the_checkpoint() -> None:
    model, optimizer = _trained()
    state = optimizer.state_dict()
    # A checkpoint of the same net saved under other module names ("net.0" for "0"): K-FAC alone
    # would warn that no layer matches and start fresh; the user's pre hook renames them back.
    state["kfac"]["blocks"] = {f"net.{name}": block for name, block in state["kfac"]["blocks"].items()}
    optimizer.remove_hooks()
    fresh = KFAC(model, lr=0.1, momentum=0.9, decomposition_update_steps=1, factor_update_steps=1)

    def rename(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        blocks = {name.removeprefix("net."): block for name, block in state_dict["kfac"]["blocks"].items()}
        return {**state_dict, "kfac": {**state_dict["kfac"], "blocks": blocks}}

    fresh.register_load_state_dict_pre_hook(rename)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "does not match the model" warning
        fresh.load_state_dict(state)
    assert fresh.steps == 2
    for saved, loaded in zip(optimizer.blocks, fresh.blocks, strict=True):
        for name in saved.factors:
            assert torch.equal(saved.factors[name].running, loaded.factors[name].running)


def test_a_load_pre_hook_sees_the_kfac_entry() -> None:
    _, optimizer = _trained()
    seen: list[bool] = []
    optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: seen.append("kfac" in state_dict))
    optimizer.load_state_dict(optimizer.state_dict())
    assert seen == [True]


def _sgd_only_model() -> nn.Module:
    """A model without any K-FAC layer: ``KFAC`` is then exactly SGD."""

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.weight).sum(-1)

    torch.manual_seed(1)
    return Scale()


@pytest.mark.filterwarnings("ignore:model has no supported layer")
def test_an_sgd_state_dict_without_maximize_and_foreach_loads_and_steps_as_under_sgd() -> None:
    model = _sgd_only_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 5)).sum().backward()
    sgd.step()
    old = sgd.state_dict()
    for group in old["param_groups"]:  # as saved by a torch before these options existed
        del group["maximize"], group["foreach"]

    results = []
    for make in (
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        lambda m: KFAC(m, lr=0.1, momentum=0.9, factor_update_steps=1, decomposition_update_steps=10),
    ):
        replica = _sgd_only_model()
        replica.load_state_dict(model.state_dict())
        optimizer = make(replica)
        optimizer.load_state_dict(copy.deepcopy(old))  # SGD's steps update the loaded buffers in place
        assert optimizer.param_groups[0]["maximize"] is False
        assert optimizer.param_groups[0]["foreach"] is None
        for _ in range(2):
            optimizer.zero_grad()
            replica(torch.ones(3, 5)).sum().backward()
            optimizer.step()
        results.append(replica.weight.detach().clone())
    assert torch.equal(results[0], results[1])
