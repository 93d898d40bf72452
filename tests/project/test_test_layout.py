"""The test suite's own layout: its folders mirror the package's, and every helper is defined once.

A test of one package folder of ``src/kfac_optim`` lives in the ``tests/`` folder of that name
(tests/layers/, tests/methods/, ...); tests of the root modules live in tests/optim/, and tests that
cross packages in a folder named for their kind (integration, distributed runs, scripts, ...).

A test module's top-level functions and classes other than ``test_*`` (models, batches, dense
references, fixtures, scenarios) are its helpers. One defined under the same name in two files
(tests/helpers.py and tests/distributed_helpers.py included) is a copy waiting to drift: shared
ones live in tests/helpers.py (or tests/distributed_helpers.py) and are imported; file-specific
ones get a name that says what they are.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
PACKAGE = TESTS.parent / "src" / "kfac_optim"
KINDS = {"optim": "the root modules", "integration": "training loops across packages",
         "scripts": "examples and benchmarks", "project": "the repository's own checks",
         "models": "real model zoos", "cuda": "GPU-only runs", "apex_standin": "a stand-in package"}


def helper_definitions(paths: list[Path]) -> dict[str, list[str]]:
    """``{name: ["file:line", ...]}`` of the top-level non-test functions and classes in ``paths``."""
    where: dict[str, list[str]] = defaultdict(list)
    for path in paths:
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            is_definition = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if is_definition and not node.name.startswith("test_"):
                # test file names are unique (pytest's rootdir-less import)
                where[node.name].append(f"{path.name}:{node.lineno}")
    return where


def test_no_helper_is_defined_in_more_than_one_test_file() -> None:
    paths = sorted(p for p in TESTS.rglob("*.py") if "apex_standin" not in p.parts)
    assert len(paths) > 20 and TESTS / "helpers.py" in paths
    copies = {name: places for name, places in helper_definitions(paths).items()
              if len({place.partition(":")[0] for place in places}) > 1}
    assert copies == {}


def test_the_scan_finds_a_copied_helper(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text("def batch():\n    pass\n\nclass Net:\n    pass\n\ndef test_a():\n    pass\n")
    (tmp_path / "test_two.py").write_text("def batch(n):\n    pass\n\ndef test_a():\n    pass\n")
    found = helper_definitions(sorted(tmp_path.glob("*.py")))
    assert found == {"batch": ["test_one.py:1", "test_two.py:1"], "Net": ["test_one.py:4"]}


def test_every_test_folder_is_a_package_folder_or_a_kind_of_test() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert {"layers", "methods", "distributed"} <= folders & packages
    assert sorted(folders - packages - set(KINDS)) == []
