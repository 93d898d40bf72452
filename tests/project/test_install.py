"""The install: torch and torchvision work together, and collecting the suite never needs torchvision.

A torch/torchvision pair that pip installs but that cannot work together (a CUDA torchvision
beside a CPU-only torch: pip checks versions, not builds) fails one test here, whose message
names the fix; the tests that need torchvision skip (``tests.helpers.import_torchvision``), and
every other test runs. Before, one benchmark module imported torchvision at import time and its
``RuntimeError`` aborted the collection of the whole suite.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import torchvision_problem

ROOT = Path(__file__).resolve().parents[2]
# Packages whose import imports torchvision (Lightning imports torchmetrics, which imports torchvision).
IMPORT_TORCHVISION = {"torchvision", "torchmetrics", "pytorch_lightning", "lightning"}


def module_level_imports(path: Path) -> set[str]:
    """Top-level package names a module imports when it is imported (not inside functions)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.partition(".")[0])
    return names


def test_torchvision_works_with_this_torch() -> None:
    problem = torchvision_problem()
    assert problem is None, problem


def test_no_module_the_suite_imports_needs_torchvision_at_import_time() -> None:
    """Test modules and what they import (examples/, benchmarks/) import torchvision, or packages that
    do, inside the functions that use them."""
    paths = [p for folder in ("tests", "examples", "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(paths) > 50
    offenders = {str(p.relative_to(ROOT)): sorted(module_level_imports(p) & IMPORT_TORCHVISION) for p in paths}
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_scan_sees_module_level_imports_only(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os, torchvision.models\nfrom pytorch_lightning import Trainer\n\n"
                      "def f():\n    import torchmetrics\n")
    assert module_level_imports(module) == {"os", "torchvision", "pytorch_lightning"}
