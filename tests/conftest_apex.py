"""Install the CPU Apex stand-in (``tests/apex_standin/apex``) as ``apex`` for one test.

Use the ``fake_apex`` fixture (import it into a test module), or call ``install_fake_apex`` from
your own fixture. Everything is undone at teardown: the ``apex*`` entries of ``sys.modules`` (a
real Apex, if one is installed, is hidden meanwhile), ``sys.path``, and every torch function
that O1's ``amp.initialize`` patches, so each test starts from fresh Amp state.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import Optimizer

STANDIN_ROOT = Path(__file__).parent / "apex_standin"


def _apex_module_names() -> list[str]:
    return [name for name in sys.modules if name == "apex" or name.startswith("apex.")]


def install_fake_apex(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import a fresh stand-in as ``apex``; return its ``apex.amp``. ``monkeypatch`` undoes it."""
    for name in _apex_module_names():
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(STANDIN_ROOT))
    importlib.import_module("apex")
    for name in _apex_module_names():
        module = sys.modules.pop(name)
        monkeypatch.setitem(sys.modules, name, module)
    amp = sys.modules["apex.amp"]
    for namespace, attr in amp.amp.PATCHED_TARGETS:
        monkeypatch.setattr(namespace, attr, getattr(namespace, attr))
    return amp


@pytest.fixture
def fake_apex(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The stand-in's ``apex.amp`` module, installed for the duration of one test."""
    yield install_fake_apex(monkeypatch)


def scaled_step(amp: ModuleType, model: nn.Module, optimizer: Optimizer, x: Tensor, y: Tensor) -> float:
    """One Apex-style training step (``amp.scale_loss`` around backward); returns the loss."""
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    return loss.item()
