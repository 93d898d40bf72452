"""docs/api.md's signatures and config tables are the code's: each documented ``name(parameters)``
against ``inspect.signature``, each config table against the dataclass's fields; and every
``kfac_optim.a.b`` the README and docs/ name exists.

What counts as a documented signature (so the page can still show calls as examples):
- a line of a fenced block without a language that starts ``KFAC(`` or ``kfac_optim.NAME(`` (it may
  continue on the next lines until its parentheses close);
- a heading ``## `kfac_optim.NAME(...)` ``;
- a bold code span ``**`NAME(...)`**`` (a bare ``NAME`` is a method of ``KFAC``).
Each must list the parameters in order, with the same kind (positional or keyword-only, ``*``) and
the same defaults (``...`` stands for any default); ``self`` and a ``**kwargs`` catch-all may be
left out. A table after ``**`XConfig`**`` (columns field | default | meaning) must name the
dataclass's fields in order, with their defaults.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import kfac_optim

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"
ANY = object()  # a documented default of `...`


def _balanced(text: str, start: int) -> int:
    """The index just past the parenthesis that closes the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i + 1
    raise AssertionError(f"unbalanced parentheses in {text[start:start + 80]!r}")


def documented_signatures(text: str) -> list[tuple[str, str, int]]:
    """``(name, parameter text, line)`` of every signature the page documents (see the module docstring)."""
    found = []
    for block in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M):
        if block[1]:
            continue  # a ```python block: code, not signatures
        body = block[2]
        for match in re.finditer(r"^(KFAC|kfac_optim\.[\w.]+)\(", body, re.M):
            end = _balanced(body, match.end() - 1)
            found.append((match[1], body[match.end():end - 1], text.count("\n", 0, block.start(2) + match.start()) + 1))
    for match in re.finditer(r"^#+ `(kfac_optim\.[\w.]+)\((.*)\)`$", text, re.M):
        found.append((match[1], match[2], text.count("\n", 0, match.start()) + 1))
    for match in re.finditer(r"\*\*`([\w.]+)\((.*?)\)`\*\*", text, re.S):
        found.append((match[1], match[2], text.count("\n", 0, match.start()) + 1))
    return found


def resolve(name: str) -> Any:
    """The object a documented name means: ``KFAC``, ``kfac_optim.a.b.C``, or a bare ``KFAC`` method."""
    if name == "KFAC" or "." not in name:
        return kfac_optim.KFAC if name == "KFAC" else getattr(kfac_optim.KFAC, name)
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            thing = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            thing = getattr(thing, part)
        return thing
    raise AssertionError(f"cannot resolve {name}")


def documented_parameters(params: str) -> list[tuple[str, str, Any]]:
    """``(name, kind, default)`` of a documented parameter list (parsed as a ``def``'s)."""
    arguments = ast.parse(f"def _({params}): pass").body[0].args
    namespace = {"torch": torch}

    def value(node: ast.expr | None) -> Any:
        if node is None:
            return inspect.Parameter.empty
        if isinstance(node, ast.Constant) and node.value is Ellipsis:
            return ANY
        return eval(compile(ast.Expression(node), "api.md", "eval"), namespace)  # noqa: S307 (our own docs)

    positional = arguments.posonlyargs + arguments.args
    defaults = [None] * (len(positional) - len(arguments.defaults)) + list(arguments.defaults)
    out = [(a.arg, "positional", value(d)) for a, d in zip(positional, defaults, strict=True)]
    out += [(a.arg, "keyword", value(d)) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)]
    return out


def actual_parameters(thing: Any) -> list[tuple[str, str, Any]]:
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional", inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
             inspect.Parameter.KEYWORD_ONLY: "keyword"}
    return [(p.name, kinds[p.kind], p.default) for p in inspect.signature(thing).parameters.values()
            if p.name != "self" and p.kind in kinds]


SIGNATURES = documented_signatures(API.read_text(encoding="utf-8"))


def test_the_page_documents_the_signatures_this_test_knows() -> None:
    names = {name for name, _, _ in SIGNATURES}
    assert {"KFAC", "kfac_optim.CurvatureConfig", "kfac_optim.AsyncConfig", "kfac_optim.RuntimeConfig",
            "kfac_optim.UpdateConfig", "kfac_optim.AdaptiveDamping", "kfac_optim.EigenAdam",
            "kfac_optim.MilestoneSchedule", "kfac_optim.Method.precondition", "step", "sample_fisher"} <= names


@pytest.mark.parametrize(("name", "params", "line"), SIGNATURES, ids=[f"{n}@{line}" for n, _, line in SIGNATURES])
def test_a_documented_signature_is_the_code_s(name: str, params: str, line: int) -> None:
    documented = documented_parameters(params)
    actual = actual_parameters(resolve(name))
    where = f"docs/api.md:{line} {name}"
    assert [(n, k) for n, k, _ in documented] == [(n, k) for n, k, _ in actual], where
    for (parameter, _, doc_default), (_, _, default) in zip(documented, actual, strict=True):
        if doc_default is not ANY:
            assert doc_default == default, f"{where}: {parameter}={doc_default!r}, the code says {default!r}"


def config_tables(text: str) -> dict[str, list[tuple[list[str], list[str]]]]:
    """``{config name: [(field names of a row, its default cells' code spans)]}`` of each config table."""
    tables = {}
    for match in re.finditer(r"^\*\*`(\w+Config)`\*\*.*?\n\| field \| default \| meaning "
                             r"\|\n\|[-|]+\|\n((?:\|[^\n]*\n)+)",
                             text, re.S | re.M):
        rows = []
        for row in match[2].splitlines():
            cells = [cell.strip() for cell in row.strip("|").split(" | ")]
            rows.append((re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([^`]+)`", cells[1].split(" (")[0])))
        tables[match[1]] = rows
    return tables


def test_each_config_table_lists_the_dataclass_fields_in_order_with_their_defaults() -> None:
    tables = config_tables(API.read_text(encoding="utf-8"))
    assert set(tables) == {"CurvatureConfig", "AsyncConfig", "RuntimeConfig", "UpdateConfig"}
    for name, rows in tables.items():
        fields = {f.name: f for f in dataclasses.fields(getattr(kfac_optim, name))}
        assert [n for names, _ in rows for n in names] == list(fields), name
        for names, defaults in rows:
            for field, default in zip(names, defaults * len(names) if len(defaults) == 1 else defaults, strict=True):
                value = eval(default, {"torch": torch})  # noqa: S307 (our own docs)
                assert value == fields[field].default, (f"{name}.{field}: documented {default}, "
                                                        f"the code says {fields[field].default!r}")


def test_the_kfac_argument_table_names_every_parameter() -> None:
    text = API.read_text(encoding="utf-8")
    table = text[text.index("| argument | default | meaning |"):]
    table = table[: table.index("\n\n")]
    names = [n for row in table.splitlines()[2:] for n in re.findall(r"`(\w+)`", row.split(" | ")[0])]
    assert sorted(names) == sorted(n for n, _, _ in actual_parameters(kfac_optim.KFAC))


def test_every_dotted_name_the_documents_use_exists() -> None:
    """``kfac_optim.a.b`` anywhere in the README or docs/ names a module or attribute that exists."""
    root = API.parent.parent
    missing = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for name in sorted(set(re.findall(r"\bkfac_optim(?:\.\w+)+", path.read_text(encoding="utf-8")))):
            try:
                resolve(name)
            except (AttributeError, AssertionError):
                missing.append(f"{path.name}: {name}")
    assert missing == []
