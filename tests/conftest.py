"""Shared test settings: deterministic, single-threaded CPU math; the ``apex`` marker on every
test that uses the Apex stand-in's ``fake_apex`` fixture (tests/conftest_apex.py); a header line
saying whether torchvision works with this torch (tests/project/test_install.py)."""

from pathlib import Path

import pytest
import torch

from helpers import torchvision_problem


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def module_tmp_path(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """A temporary folder shared by one test module's fixtures and tests (what spawned ranks saved)."""
    return tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``apex`` every test that installs the Apex stand-in through the ``fake_apex`` fixture,
    wherever it lives, so ``pytest -m "not apex"`` leaves out the whole stand-in suite."""
    for item in items:
        if "fake_apex" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.apex)


def pytest_report_header() -> str:
    """torch's version, and torchvision's state: the fix when the pair cannot work together."""
    problem = torchvision_problem()
    return f"torch {torch.__version__}; " + ("torchvision works with it" if problem is None else problem)
