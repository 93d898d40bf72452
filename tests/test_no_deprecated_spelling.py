"""The examples and benchmarks build ``KFAC`` in the current spelling: no ``DeprecationWarning``.

Every K-FAC run of every config file in configs/ (with the flat keys that map to configs, and the
``--set`` overrides RESULTS.md uses), the recipes' and the benchmarks' optimizers, built with
``DeprecationWarning`` as an error.
"""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest
from torch import nn

import kfac_optim
from examples.training.config import load_experiment
from examples.training.optimizers import build_optimizer
from kfac_optim.config import FLAT_KEYWORDS

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_files_build_kfac_without_deprecation_warnings(path: Path) -> None:
    runs = [run for run in load_experiment(path).runs if run.optim.name == "kfac"]
    assert runs, f"{path.name} has no K-FAC run"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for run in runs:
            optimizer = build_optimizer(run.optim, small_model(), steps_per_epoch=10)
            assert isinstance(optimizer, kfac_optim.KFAC)


@pytest.mark.parametrize("override, expected", [
    ("kfac.optim.kfac.fisher=sampled", ("curvature", "fisher", "sampled")),
    ("kfac.optim.kfac.stagger_factor_updates=true", ("curvature", "stagger", True)),
    ("kfac.optim.kfac.async_statistics=true", None),
    ("kfac.optim.kfac.async_delay=1", ("asynchronous", "delay", 1)),
])
def test_flat_config_keys_reach_the_configs_without_deprecation_warnings(override: str, expected) -> None:
    """The flat keys of the config files (and RESULTS.md's ``--set`` commands) go into the configs."""
    experiment = load_experiment(CONFIGS[[p.stem for p in CONFIGS].index("digits")], [override], only=["kfac"])
    (run,) = experiment.runs
    key = override.split("=")[0].rsplit(".", 1)[1]
    assert key in FLAT_KEYWORDS
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        optimizer = build_optimizer(run.optim, small_model(), steps_per_epoch=10)
    if expected is not None:
        config, field, value = expected
        holder = optimizer.options.curvature if config == "curvature" else optimizer.options.asynchronous
        assert getattr(holder, field) == value


def test_recipes_and_benchmarks_spell_kfac_without_deprecated_keywords() -> None:
    """No deprecated flat keyword is passed to a ``KFAC(...)`` call in examples/ or benchmarks/ (a
    scan of the calls' own keywords: the distributed ones need process groups to run)."""
    root = Path(__file__).parents[1]
    offenders = []
    for path in [*root.glob("examples/**/*.py"), *root.glob("benchmarks/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "KFAC":
                offenders += [f"{path.relative_to(root)}:{node.lineno}: {k.arg}=" for k in node.keywords
                              if k.arg in FLAT_KEYWORDS]
    assert not offenders, offenders


def deprecated_spellings(text: str) -> list[str]:
    """Each flat keyword ``old=`` in ``text`` that is not spelled as its config's field: inside
    ``CurvatureConfig(...)``/``AsyncConfig(...)``/``RuntimeConfig(...)``, or as ``Config.field=``."""
    found = []
    for match in re.finditer(r"(?<![\w.])(" + "|".join(FLAT_KEYWORDS) + r")=", text):
        if not re.search(r"(Curvature|Async|Runtime)Config\([^()]*$", text[: match.start()]):
            found.append(match.group(0))
    return found


def message_text(node: ast.AST) -> str:
    """The literal text of a message argument (the constant parts of an f-string, ``...`` for the rest)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "..." for v in node.values)
    if isinstance(node, ast.BinOp):
        return message_text(node.left) + message_text(node.right)
    return ""


def test_the_library_s_warnings_and_errors_recommend_the_current_spelling() -> None:
    """Every message the library warns, logs or raises names settings as they are spelled now
    (``KFAC(..., runtime=RuntimeConfig(grad_scaler=scaler))``, not the deprecated ``grad_scaler=``)."""
    root = Path(__file__).parents[1] / "src" / "kfac_optim"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                text = " ".join(message_text(arg) for arg in node.args)
                offenders += [f"{path.relative_to(root)}:{node.lineno}: {s}" for s in deprecated_spellings(text)]
    assert offenders == []


def test_the_spelling_scan_tells_current_from_deprecated() -> None:
    assert deprecated_spellings("Pass KFAC(..., grad_scaler=scaler).") == ["grad_scaler="]
    assert deprecated_spellings("use async_statistics=False") == ["async_statistics="]
    assert deprecated_spellings("Pass KFAC(..., runtime=RuntimeConfig(grad_scaler=scaler)).") == []
    assert deprecated_spellings("RuntimeConfig(process_group=..., grad_worker_fraction=1)") == []
    assert deprecated_spellings("got RuntimeConfig.grad_worker_fraction=0.3") == []
