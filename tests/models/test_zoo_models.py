"""K-FAC inside real-library models: the zoo of ``benchmarks.zoo`` (tiny configs, random weights).

For every entry whose library imports here (the others skip): ``KFAC(model, lr)`` constructs and
steps with a finite loss that falls on the entry's teacher-labelled batch; ``describe()`` lists as
K-FAC only blocks that received statistics, and the entry's known layer kinds are covered (GPT-2's
``Conv1D``); a checkpoint taken after step 1 and loaded into a freshly built model and optimizer
continues bit for bit as the uninterrupted run.

The controls are runs of the same code: the uninterrupted run for the resumed one, the first loss
for the last. Left out to keep the suite short: ``tv_resnet18`` (11M parameters, 4608-wide factors:
its step is the benchmark's business, ``python -m benchmarks.zoo``), ``mistral`` (Llama's modules
with a sliding window: ``llama`` covers them) and ``tv_vit`` (``timm_vit`` and ``hf_vit`` cover the
ViTs).
"""

from __future__ import annotations

import importlib.util
import io
import warnings
from typing import Any

import pytest
import torch
from helpers import torchvision_problem
from torch import nn

from benchmarks.zoo import ZOO, ZooBatch, ZooModel
from kfac_optim import KFAC

LEFT_OUT = {"tv_resnet18", "mistral", "tv_vit"}  # the step's cost; twins of llama and timm_vit (module docstring)
TESTED = [name for name in ZOO if name not in LEFT_OUT]
ZOO_SETTINGS: dict[str, Any] = dict(lr=0.02, momentum=0.0, factor_update_steps=1, decomposition_update_steps=2)
LIBRARIES = {"peft": ("peft", "transformers")}


def zoo_entry(name: str) -> ZooModel:
    """The entry, or skip: its library (or one its models need) is not installed or does not import."""
    entry = ZOO[name]
    for library in LIBRARIES.get(entry.library, (entry.library,)):
        if library == "torchvision" and torchvision_problem() is not None:
            pytest.skip("torchvision does not work with this torch: tests/project/test_install.py says why")
        if importlib.util.find_spec(library) is None:
            pytest.skip(f"{library} is not installed")
    return entry


def zoo_model_and_batch(entry: ZooModel) -> tuple[nn.Module, ZooBatch]:
    """The entry's model (seed 0) and its batch of 4 (seed 1)."""
    torch.manual_seed(0)
    model = entry.build()
    return model, entry.batch(4, torch.Generator().manual_seed(1))


def zoo_steps(entry: ZooModel, model: nn.Module, optimizer: KFAC, batch: ZooBatch, steps: int) -> list[float]:
    """``steps`` training steps on ``batch``; the losses before each."""
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = entry.loss(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def quietly(function: Any, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` with the warnings about the model's layers silenced (they are the subject
    of tests/integration/test_coverage_reports.py, not of this suite)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return function(*args, **kwargs)


@pytest.mark.parametrize("name", TESTED)
def test_kfac_steps_a_zoo_model_and_describes_only_blocks_with_statistics(name: str) -> None:
    entry = zoo_entry(name)
    model, batch = zoo_model_and_batch(entry)
    optimizer = quietly(KFAC, model, **ZOO_SETTINGS)
    losses = quietly(zoo_steps, entry, model, optimizer, batch, 4)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses

    reports = optimizer.module_reports
    blocks = {block.name: block for block in optimizer.blocks}
    described = [r for r in reports if r.status == "kfac" and r.block in blocks and not blocks[r.block].frozen]
    assert described, optimizer.describe()  # frozen blocks (peft's base model) record nothing by design
    assert all(blocks[r.block].has_statistics for r in described), optimizer.describe()
    silent = {r.name for r in reports if r.status == "silent"}
    assert silent == {b.name for b in optimizer.blocks if not (b.has_statistics or b.frozen) and b.sgd_reason is None}
    preconditioning = [b for b in optimizer.blocks if (b.has_statistics or b.frozen) and b.sgd_reason is None]
    assert optimizer.describe().startswith(f"KFAC (eigen): {len(preconditioning)} blocks precondition ")


def test_gpt2s_conv1d_layers_are_preconditioned() -> None:
    entry = zoo_entry("gpt2")
    model, batch = zoo_model_and_batch(entry)
    optimizer = quietly(KFAC, model, **ZOO_SETTINGS)
    quietly(zoo_steps, entry, model, optimizer, batch, 1)
    conv1d = {r.name: r for r in optimizer.module_reports if r.kind == "Conv1D"}
    assert len(conv1d) == 8  # 2 layers: attention c_attn, c_proj; MLP c_fc, c_proj
    assert all(r.status == "kfac" and "TransposedLinearBlock" in r.detail for r in conv1d.values()), conv1d


def test_mambas_functionally_called_layers_are_described_as_silent() -> None:
    """Without its CUDA kernels, transformers' Mamba mixer uses its ``conv1d`` and ``dt_proj`` through
    their parameters (the reference path): those blocks never record, and say so."""
    entry = zoo_entry("mamba")
    model, batch = zoo_model_and_batch(entry)
    optimizer = quietly(KFAC, model, **ZOO_SETTINGS)
    quietly(zoo_steps, entry, model, optimizer, batch, 1)
    never = {b.name for b in optimizer.blocks if not b.has_statistics}
    assert never, "every Mamba block recorded: the reference path changed, update this test"
    reports = {r.name: r for r in optimizer.module_reports}
    assert all(reports[name].status == "silent" and reports[name].block is None for name in never)


@pytest.mark.parametrize("name", TESTED)
def test_a_zoo_model_resumed_from_a_checkpoint_continues_bit_for_bit(name: str) -> None:
    entry = zoo_entry(name)
    model, batch = zoo_model_and_batch(entry)
    optimizer = quietly(KFAC, model, **ZOO_SETTINGS)
    quietly(zoo_steps, entry, model, optimizer, batch, 1)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, saved)
    quietly(zoo_steps, entry, model, optimizer, batch, 2)  # a factor step, then a decomposition step

    fresh, _ = zoo_model_and_batch(entry)
    with torch.no_grad():  # not the same start: the checkpoint must carry everything
        for p in fresh.parameters():
            p.add_(1.0)
    resumed = quietly(KFAC, fresh, **ZOO_SETTINGS)
    saved.seek(0)
    state = torch.load(saved, weights_only=False)
    fresh.load_state_dict(state["model"])
    resumed.load_state_dict(state["optimizer"])
    quietly(zoo_steps, entry, fresh, resumed, batch, 2)
    differing = [n for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True)
                 if not torch.equal(p, q)]
    assert differing == []
