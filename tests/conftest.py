"""Shared test settings: deterministic, single-threaded CPU math."""

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def module_tmp_path(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """A temporary folder shared by one test module's fixtures and tests (what spawned ranks saved)."""
    return tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
