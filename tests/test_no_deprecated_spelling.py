"""The examples and benchmarks build ``KFAC`` in the current spelling: no ``DeprecationWarning``.

Every K-FAC run of every config file in configs/ (with the flat keys that map to configs, and the
``--set`` overrides RESULTS.md uses), the recipes' and the benchmarks' optimizers, built with
``DeprecationWarning`` as an error.
"""

from __future__ import annotations

import ast
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
