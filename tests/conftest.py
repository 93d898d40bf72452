"""Shared test settings: deterministic, single-threaded CPU math; the order (the folders whose
tests spawn processes first, for pytest-xdist's workers); the ``apex`` marker on every
test that uses the Apex stand-in's ``fake_apex`` fixture (tests/conftest_apex.py); a header line
saying whether torchvision works with this torch (tests/project/test_install.py); the end of the
spawned rank pools (tests/distributed_helpers.py); one fresh interpreter's view of
importing and using kfac_optim (``fresh_kfac_interpreter``)."""

import json
import subprocess
import sys
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


@pytest.fixture(scope="session")
def fresh_kfac_interpreter() -> dict[str, object]:
    """What a fresh interpreter that cannot import apex saw: whether importing ``kfac_optim`` and
    ``kfac_optim.layers`` imported transformers, and ``KFAC.steps`` after one step of a Linear layer.
    One interpreter for the import checks of several test files (each start costs seconds)."""
    code = (
        "import json, sys; sys.modules['apex'] = None\n"  # any `import apex` now raises ImportError
        "import torch, kfac_optim, kfac_optim.layers\n"
        "transformers = 'transformers' in sys.modules\n"
        "model = torch.nn.Linear(4, 2)\n"
        "opt = kfac_optim.KFAC(model, lr=0.1)\n"
        "model(torch.randn(8, 4)).square().mean().backward()\n"
        "opt.step()\n"
        "print(json.dumps({'transformers imported': transformers, 'steps': opt.steps}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=True, timeout=60, stdout=subprocess.PIPE, text=True)
    return json.loads(result.stdout.splitlines()[-1])


SLOW_FOLDERS_FIRST = ("scripts", "distributed")
"""Folders whose tests spawn processes (scripts, torchrun, gloo ranks): about two thirds of the
suite's time in a few files. Run first, pytest-xdist's workers share them and end together."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the tests with :data:`SLOW_FOLDERS_FIRST` first (otherwise as collected); mark ``apex``
    every test that installs the Apex stand-in through the ``fake_apex`` fixture, wherever it
    lives, so ``pytest -m "not apex"`` leaves out the whole stand-in suite."""
    def folder_rank(item: pytest.Item) -> int:
        folder = item.path.parent.name
        return SLOW_FOLDERS_FIRST.index(folder) if folder in SLOW_FOLDERS_FIRST else len(SLOW_FOLDERS_FIRST)

    items.sort(key=folder_rank)
    for item in items:
        if "fake_apex" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.apex)


def pytest_report_header() -> str:
    """torch's version, and torchvision's state: the fix when the pair cannot work together."""
    problem = torchvision_problem()
    return f"torch {torch.__version__}; " + ("torchvision works with it" if problem is None else problem)


def _close_rank_pools(larger_than: int = 0) -> None:
    """End the pools of spawned gloo ranks that tests/distributed_helpers.py keeps for reuse."""
    for name in ("tests.distributed_helpers", "distributed_helpers"):  # imported under either name
        if name in sys.modules:
            sys.modules[name].close_pools(larger_than)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Pools of more than 2 ranks serve one folder of tests (tests/distributed): end them when it is done."""
    if nextitem is None or nextitem.path.parent != item.path.parent:
        _close_rank_pools(larger_than=2)


def pytest_sessionfinish() -> None:
    _close_rank_pools()
