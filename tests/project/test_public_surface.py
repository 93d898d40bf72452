"""The scripts beside the library use its public surface only (docs/design.md §2, §4).

Benchmarks and examples must not reach into private state of `KFAC`, its blocks or its
communicator (an attribute `x._name` of anything but their own `self`), must not replace the
optimizer's attributes, must not write the attributes of its blocks and factors (their state
changes only through their methods), and must not edit `sys.path` (they run as modules from the
repository root).
The instrumentation they read instead (profiler ranges, byte counters, read-only properties) is
checked here on a real 2-layer model.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_optim import KFAC, Eigen
from kfac_optim.layers import LinearBlock

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "examples").rglob("*.py")])
KFAC_ATTRIBUTES = {"options", "blocks", "model", "param_groups", "state"}


def _block_and_factor_attributes() -> set[str]:
    """The public data attributes of a real block and of its factors (e.g. ``pending_rows``,
    ``decomposed_key``, ``decomposition``): what a script must not assign."""
    layer = nn.Linear(2, 2)
    block = LinearBlock("probe", layer, True, torch.float32)
    names = set(vars(block)).union(*(vars(factor) for factor in block.factors.values()))
    # A layer's own attributes (``head.weight = token.weight`` ties a model) are model code, not block writes.
    return {name for name in names if not name.startswith("_")} - set(dir(layer))


BLOCK_AND_FACTOR_ATTRIBUTES = _block_and_factor_attributes()


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _violations(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.endswith("__")
            if private and not _is_self(node.value):
                found.append(f"{where}: private attribute {ast.unparse(node)}")
            if ast.unparse(node) == "sys.path":
                found.append(f"{where}: sys.path")
            if isinstance(node.ctx, ast.Store) and node.attr in KFAC_ATTRIBUTES and not _is_self(node.value):
                found.append(f"{where}: replaces {ast.unparse(node)}")
            if (isinstance(node.ctx, ast.Store) and node.attr in BLOCK_AND_FACTOR_ATTRIBUTES
                    and not _is_self(node.value)):
                found.append(f"{where}: writes block/factor attribute {ast.unparse(node)}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in BLOCK_AND_FACTOR_ATTRIBUTES):
            found.append(f"{where}: writes block/factor attribute {ast.unparse(node)}")
    return found


def test_the_scanned_scripts_include_every_benchmark_and_the_training_application() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in SCRIPTS}
    assert {"benchmarks/step_time.py", "benchmarks/scaling.py", "examples/train.py",
            "examples/training/trainer.py"} <= names


def test_the_scan_finds_what_it_forbids(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text("opt._capture.armed = False\nopt.options = None\nimport sys\nsys.path.insert(0, '.')\n")
    assert len(_violations(script)) == 3


def test_the_scan_finds_writes_to_block_and_factor_attributes(tmp_path: Path) -> None:
    """What benchmarks/step_time.py once did to re-fold and re-decompose: writes to a block's and
    its factors' counters and cache keys (and the same through ``setattr`` or ``+=``)."""
    assert {"pending_rows", "pending_samples", "decomposed_key", "decomposition",
            "running"} <= BLOCK_AND_FACTOR_ATTRIBUTES
    script = tmp_path / "probe.py"
    script.write_text(
        "block.pending_samples, block.A.pending_rows = 3, 4\n"
        "factor.decomposed_key = None\n"
        "other.decomposition, other.decomposed_key = factor.decomposition, factor.decomposed_key\n"
        "setattr(factor, 'running', None)\n"
        "block.G.pending_rows += 1\n"
        "capture.armed = False\n"  # not a block or factor attribute: allowed
    )
    found = _violations(script)
    assert len(found) == 7 and all("writes block/factor attribute" in f for f in found), found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_script_uses_no_private_attribute_and_no_sys_path(path: Path) -> None:
    assert _violations(path) == []


def _model_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(8, 6), torch.randint(0, 3, (8,))


def test_step_marks_its_phases_with_profiler_ranges() -> None:
    model, x, y = _model_and_batch()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    names = {event.name for event in profile.events()}
    expected = {"kfac.step", "kfac.fold", "kfac.reduce_factors", "kfac.decompose", "kfac.share_decompositions",
                "kfac.precondition", "kfac.share_directions", "kfac.kl_clip", "kfac.sgd"}
    assert expected <= names


def test_read_only_properties_follow_the_schedule() -> None:
    model, x, y = _model_and_batch()
    optimizer = KFAC(model, lr=0.1, factor_update_steps=2, decomposition_update_steps=10)
    seen = []
    for _ in range(3):
        seen.append((optimizer.steps, optimizer.capturing))
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert seen == [(0, True), (1, False), (2, True)]
    with pytest.raises(AttributeError):
        optimizer.steps = 5  # type: ignore[misc]
    assert set(optimizer.owned_factors) == {"0.A", "0.G", "2.A", "2.G"}  # one process owns all
    assert optimizer.bytes_communicated() == {"factors": 0, "decompositions": 0, "directions": 0}


def test_a_factor_that_takes_seconds_to_decompose_is_noted_once(caplog: pytest.LogCaptureFixture) -> None:
    with torch.device("meta"):  # only the sizes matter: nothing is allocated
        model = nn.Sequential(nn.Linear(4095, 8), nn.Linear(8, 4096, bias=False))
    with caplog.at_level("WARNING", logger="kfac_optim.optimizer"):
        KFAC(model, lr=0.1, method=Eigen(max_rank=None), factor_update_steps=1, decomposition_update_steps=10)
    (record,) = [r for r in caplog.records if "seconds" in r.getMessage()]
    assert "0.A (4096)" in record.getMessage() and "1.G (4096)" in record.getMessage()


def test_factors_under_the_eigenbasis_cap_are_not_noted_as_slow(caplog: pytest.LogCaptureFixture) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4095, 8), nn.Linear(8, 4096, bias=False))
    with caplog.at_level("WARNING", logger="kfac_optim.optimizer"):
        KFAC(model, lr=0.1, factor_update_steps=1, decomposition_update_steps=10)  # Eigen(max_rank=128): O(n²·128)
    assert [r for r in caplog.records if "seconds" in r.getMessage()] == []
