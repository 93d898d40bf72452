"""Checkpoints of ``KFAC(asynchronous=AsyncConfig())`` taken while a round of decompositions is in flight.

A round starts at a decomposition step and is adopted at the next one (or ``AsyncConfig.delay`` steps
later). ``state_dict()`` saves it (waiting for the worker), so a run resumed from it adopts the same
decompositions at the same step as the run that never stopped: parameters bit-identical.
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import seeded_batch
from torch import nn

from kfac_optim import KFAC, AsyncConfig, RuntimeConfig

STEPS = 12
# Decomposition steps 0, 3, 6, 9: step 0 decomposes in line, step 3 hands a round to the worker,
# adopted at step 6 (delay None) or 5 (delay 2).
SETTINGS = dict(
    lr=0.05, momentum=0.9, damping=0.05, factor_update_steps=1, decomposition_update_steps=3, asynchronous=AsyncConfig()
)


class CheckpointNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.head = nn.Linear(3 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


def checkpoint_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_batch((8, 1, 6, 6), 5, seed=step)


def fresh(**settings) -> tuple[CheckpointNet, KFAC]:
    torch.manual_seed(0)
    model = CheckpointNet()
    return model, KFAC(model, **{"factor_update_steps": 1, "decomposition_update_steps": 10, **{**SETTINGS,
                                                                                                **settings}})


def checkpoint_run(model: nn.Module, optimizer: KFAC, steps: range) -> None:
    for step in steps:
        x, y = checkpoint_batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def saved(model: nn.Module, optimizer: KFAC) -> dict:
    """A checkpoint through torch.save / torch.load(weights_only=True), as a user writes one."""
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def resumed(checkpoint: dict, **settings) -> tuple[CheckpointNet, KFAC]:
    model, optimizer = fresh(**settings)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return model, optimizer


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def assert_same_rounds(a: dict, b: dict) -> None:
    assert a["adopt_at"] == b["adopt_at"] and a["factors"].keys() == b["factors"].keys()
    for block, factors in b["factors"].items():
        for name, result in factors.items():
            other = a["factors"][block][name]
            assert (other["version"], other["shift"]) == (result["version"], result["shift"])
            assert all(torch.equal(other["decomposition"][k], result["decomposition"][k]) for k in ("Q", "d"))


@pytest.mark.parametrize(
    ("async_delay", "save_at", "async_statistics"),
    [(None, 4, False), (None, 6, False), (2, 4, False), (2, 5, False), (2, 4, True)],
)
def test_resume_while_a_round_is_in_flight_continues_bit_identically(
    async_delay: int | None, save_at: int, async_statistics: bool
) -> None:
    # save_at 4 and 5: step 3's round is in flight (adopted at 6, or at 5 with delay 2);
    # (None, 6): step 6 adopted it and started the next one. (2, 5): saved right before adopting.
    settings = dict(asynchronous=AsyncConfig(delay=async_delay),
                    runtime=RuntimeConfig(async_statistics=async_statistics))
    reference, reference_optimizer = fresh(**settings)
    checkpoint_run(reference, reference_optimizer, range(STEPS))

    model, optimizer = fresh(**settings)
    checkpoint_run(model, optimizer, range(save_at))
    checkpoint = saved(model, optimizer)
    checkpoint_run(model, optimizer, range(save_at, STEPS))
    assert_same_parameters(model, reference)  # saving did not change the run that saved

    model, optimizer = resumed(checkpoint, **settings)
    assert optimizer.steps == save_at
    assert_same_rounds(optimizer.state_dict()["kfac"]["round"], checkpoint["optimizer"]["kfac"]["round"])
    checkpoint_run(model, optimizer, range(save_at, STEPS))
    assert_same_parameters(model, reference)

    entry = checkpoint["optimizer"]["kfac"]["round"]
    assert entry["adopt_at"] == (None if async_delay is None else 5 if save_at < 6 else 8)
    assert set(entry["factors"]) == {"conv", "head"}
    for block in reference_optimizer.blocks:
        for factor in entry["factors"][block.name].values():
            assert set(factor["decomposition"]) == {"Q", "d"} and factor["version"] in (4, 7)


def test_a_checkpoint_between_rounds_holds_none() -> None:
    model, optimizer = fresh(asynchronous=AsyncConfig(delay=1))
    checkpoint_run(model, optimizer, range(5))  # step 3's round was adopted at step 4
    assert optimizer.state_dict()["kfac"]["round"] is None
    model, optimizer = fresh(asynchronous=None)
    checkpoint_run(model, optimizer, range(4))
    assert optimizer.state_dict()["kfac"]["round"] is None


def test_synchronous_optimizer_adopts_a_saved_round_at_once() -> None:
    model, optimizer = fresh()
    checkpoint_run(model, optimizer, range(4))
    checkpoint = saved(model, optimizer)
    _, synchronous = resumed(checkpoint, asynchronous=None)
    for block in synchronous.blocks:
        for name, factor in block.factors.items():
            held = checkpoint["optimizer"]["kfac"]["round"]["factors"][block.name][name]
            assert factor.decomposed_key == (held["version"], 0.0)
            assert torch.equal(factor.decomposition.Q, held["decomposition"]["Q"])
            assert torch.equal(factor.decomposition.d, held["decomposition"]["d"])


def test_checkpoints_without_a_round_load_into_an_async_optimizer() -> None:
    """From before rounds were saved (no entry), and from a synchronous run (None): the async
    optimizer holds the saved decompositions, so it steps as the synchronous run does until its
    first decomposition step (6), which adopts nothing and starts a round of the factors then."""
    model, optimizer = fresh(asynchronous=None)
    checkpoint_run(model, optimizer, range(4))
    checkpoint = saved(model, optimizer)
    old = copy.deepcopy(checkpoint)
    del old["optimizer"]["kfac"]["round"]
    checkpoint_run(model, optimizer, range(4, 6))  # the synchronous control
    for state in (checkpoint, old):
        resumed_model, resumed_optimizer = resumed(state)
        checkpoint_run(resumed_model, resumed_optimizer, range(4, 6))
        assert_same_parameters(resumed_model, model)
        held = {(b.name, n): (f.version, f.decomposed_key) for b in resumed_optimizer.blocks
                for n, f in b.factors.items()}
        checkpoint_run(resumed_model, resumed_optimizer, range(6, 8))  # step 6 adopts nothing, starts a round
        assert all(f.decomposed_key == held[b.name, n][1] for b in resumed_optimizer.blocks
                   for n, f in b.factors.items())
        round_ = resumed_optimizer.state_dict()["kfac"]["round"]
        assert round_ is not None and round_["factors"].keys() == {b.name for b in resumed_optimizer.blocks}
        for block, factors in round_["factors"].items():
            for name, result in factors.items():
                assert result["version"] == held[block, name][0] + 1  # the factors folded at step 6


def test_a_failed_result_in_the_round_is_reported_when_adopted() -> None:
    model, optimizer = fresh()
    checkpoint_run(model, optimizer, range(4))
    checkpoint = saved(model, optimizer)
    checkpoint["optimizer"]["kfac"]["round"]["factors"]["head"]["G"]["decomposition"] = None
    model, optimizer = resumed(checkpoint)
    kept = optimizer.blocks[1].G.decomposed_key
    checkpoint_run(model, optimizer, range(4, 6))
    with pytest.warns(RuntimeWarning, match=r"'head'.*decomposition of G failed.*last good decomposition is kept"):
        checkpoint_run(model, optimizer, range(6, 7))
    assert optimizer.blocks[1].G.decomposed_key == kept
    head = checkpoint["optimizer"]["kfac"]["round"]["factors"]["head"]
    assert optimizer.blocks[1].A.decomposed_key[0] == head["A"]["version"]
    with pytest.warns(RuntimeWarning, match=r"'head'.*decomposition of G failed"):  # adopted at once
        resumed(checkpoint, asynchronous=None)


def state_of(optimizer: KFAC) -> list:
    factors = [f for block in optimizer.blocks for f in block.factors.values()]
    return [optimizer.steps, optimizer.estimator.decomposition_steps.adopt_at] + [
        (f.version, f.decomposed_key, f.running.clone(), None if f.decomposition is None else f.decomposition.Q.clone())
        for f in factors
    ]


def assert_equal_states(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, tuple):
            assert x[:2] == y[:2] and torch.equal(x[2], y[2]) and (x[3] is y[3] is None or torch.equal(x[3], y[3]))
        else:
            assert x == y


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda r: r["factors"]["conv"]["A"]["decomposition"]["Q"].__setitem__((0, 0), float("nan")),
         r"round.*layer 'conv'.*A.*decomposition Q.*non-finite"),
        (lambda r: r["factors"]["head"]["G"]["decomposition"].__setitem__("d", torch.ones(7)),
         r"round.*layer 'head'.*G.*decomposition d.*shape"),
        (lambda r: r["factors"]["head"]["G"].__setitem__("version", -1), r"round.*layer 'head'.*G.*version"),
        (lambda r: r["factors"]["head"]["G"].__setitem__("shift", float("inf")), r"round.*layer 'head'.*G.*shift"),
        (lambda r: r["factors"]["head"].__setitem__("B", r["factors"]["head"]["G"]), r"round.*layer 'head'.*'B'"),
        (lambda r: r.__setitem__("adopt_at", 2), r"round.*adopt_at"),
    ],
)
def test_a_bad_round_is_rejected_before_anything_changes(edit, match: str) -> None:
    model, optimizer = fresh(asynchronous=AsyncConfig(delay=2))
    checkpoint_run(model, optimizer, range(4))
    checkpoint = saved(model, optimizer)
    edit(checkpoint["optimizer"]["kfac"]["round"])
    target_model, target = fresh(asynchronous=AsyncConfig(delay=2))
    checkpoint_run(target_model, target, range(5))  # step 3's round adopted at 5
    before = state_of(target)
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(checkpoint["optimizer"])
    assert_equal_states(state_of(target), before)


def test_the_dcp_state_leaves_the_round_out_and_does_not_perturb_the_run() -> None:
    # DCP writes one copy of what every rank saves; a round holds this rank's decompositions only.
    reference, reference_optimizer = fresh()
    checkpoint_run(reference, reference_optimizer, range(8))
    model, optimizer = fresh()
    checkpoint_run(model, optimizer, range(4))
    state = optimizer.kfac_state().state_dict()
    assert "round" not in state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint_run(model, optimizer, range(4, 8))
    assert_same_parameters(model, reference)
