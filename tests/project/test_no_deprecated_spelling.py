"""The repository spells ``KFAC``'s settings one way: each in its config, never as a flat keyword.

The examples and benchmarks build ``KFAC`` through the configs: every K-FAC run of every config file
in configs/ (with the flat keys the training application maps to configs, and the ``--set`` overrides
RESULTS.md uses), the recipes' and the benchmarks' optimizers. The rest of the repository: no
``KFAC(...)`` call in code or in the documents' Python blocks passes a flat keyword, and no document,
docstring or comment spells a setting the old way.
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

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


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
    root = Path(__file__).parents[2]
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


# -- the rest of the repository: code, docstrings, documents and the suite itself ------------------

ROOT = Path(__file__).parents[2]
OLD_NAMES = re.compile(r"\b(?:async_decompositions|async_delay|stagger_factor_updates)\b")
"""Flat keywords that are no config field's name: any mention is the old spelling."""


def flat_keywords_of_kfac_calls(text: str) -> list[tuple[int, str]]:
    """``(offset, keyword)`` of every flat keyword given to a ``KFAC(...)`` call in ``text`` at the
    call's own level (``KFAC(m, fisher=...)``, not ``KFAC(m, curvature=CurvatureConfig(fisher=...))``)."""
    found = []
    for match in re.finditer(r"\bKFAC\(", text):
        depth, i, starts = 1, match.end(), [match.end()]
        while depth and i < min(len(text), match.end() + 2000):
            depth += text[i] in "([{"
            depth -= text[i] in ")]}"
            if depth == 1 and text[i] == ",":
                starts.append(i + 1)
            i += 1
        for start in starts:
            word = re.match(r"\s*(\w+)\s*=(?!=)", text[start:start + 60])
            if word and word[1] in FLAT_KEYWORDS:
                found.append((start, word[1]))
    return found


def flat_keyword_calls(source: str) -> list[int]:
    """Lines of ``KFAC(...)`` calls in ``source`` that pass a flat keyword."""
    if not flat_keywords_of_kfac_calls(source):
        return []  # the text scan finds every such call cheaply; the syntax tree tells the context
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "KFAC"
            and any(k.arg in FLAT_KEYWORDS for k in node.keywords)]


def docstrings(body: list[ast.stmt]) -> list[str]:
    """The docstrings of a module's (or class's, function's) body and of everything defined in it."""
    found = []
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        found.append(body[0].value.value)
    for node in body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            found += docstrings(node.body)
    return found


def prose(path: Path) -> str:
    """The text of ``path`` where old spellings would be documentation: a Python file's docstrings
    and comments, a Markdown file whole."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        return text
    comments = re.findall(r"(?m)#[^\n]*", text)  # a '#' inside a string is read as a comment: harmless here
    return "\n".join(docstrings(ast.parse(text).body) + comments)


def test_no_code_passes_kfac_a_flat_keyword() -> None:
    """src/, tests/, examples/, benchmarks/ and the documents' Python blocks: every ``KFAC(...)`` call
    uses the configs."""
    offenders = []
    for path in sorted({*ROOT.glob("src/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("examples/**/*.py"),
                        *ROOT.glob("benchmarks/**/*.py")}):
        offenders += [f"{path.relative_to(ROOT)}:{line}"
                      for line in flat_keyword_calls(path.read_text(encoding="utf-8"))]
    for path in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]:
        for code in re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            offenders += [f"{path.relative_to(ROOT)}: {code.splitlines()[line - 1]}"
                          for line in flat_keyword_calls(code)]
    assert offenders == []


def test_no_document_or_docstring_spells_a_setting_the_old_way() -> None:
    """The README, docs/ and the docstrings and comments of src/, tests/, examples/ and benchmarks/.
    Left out: what defines or tests the flat names (kfac_optim/config.py, this file, test_config.py
    and test_message_spelling.py) and the records of past runs and changes
    (benchmarks/RESULTS.md, CHANGELOG.md), which keep the spelling of their time."""
    exempt = {ROOT / "src" / "kfac_optim" / "config.py", Path(__file__).resolve(),
              ROOT / "tests" / "optim" / "test_config.py",
              ROOT / "tests" / "project" / "test_message_spelling.py"}
    paths = [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md")), *sorted(ROOT.glob("src/**/*.py")),
             *sorted(ROOT.glob("tests/**/*.py")), *sorted(ROOT.glob("examples/**/*.py")),
             *sorted(ROOT.glob("benchmarks/**/*.py"))]
    offenders = []
    for path in paths:
        if path.resolve() in exempt:
            continue
        text = prose(path)
        offenders += [f"{path.relative_to(ROOT)}: {match[0]!r}" for match in OLD_NAMES.finditer(text)]
        offenders += [f"{path.relative_to(ROOT)}: KFAC(..., {keyword}=...)"
                      for _, keyword in flat_keywords_of_kfac_calls(text)]
    assert offenders == [], "\n".join(offenders)
