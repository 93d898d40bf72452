"""Every module of ``src/kfac_optim`` opens with a docstring of at most 25 lines.

A module's docstring states its contract (what it owns, what it must not know, the shapes and
conventions of its interface) and points to docs/ for the reasoning; a longer one is a second copy
of docs/numerics.md or docs/design.md waiting to drift from it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "kfac_optim"
LIMIT = 25


def docstring_lines(source: str) -> int:
    """Lines spanned by the module docstring of ``source`` (quotes included); 0 when it has none."""
    body = ast.parse(source).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].end_lineno - body[0].lineno + 1
    return 0


def test_every_module_docstring_is_at_most_25_lines() -> None:
    lengths = {path.relative_to(PACKAGE).as_posix(): docstring_lines(path.read_text(encoding="utf-8"))
               for path in sorted(PACKAGE.rglob("*.py"))}
    assert len(lengths) > 30
    assert {name: n for name, n in lengths.items() if n > LIMIT} == {}


def test_the_count_spans_the_docstring_only() -> None:
    assert docstring_lines('"""One line."""\nx = 1\n') == 1
    assert docstring_lines('"""Title.\n\nOwns: a.\nMust not know: b.\n"""\n\nimport os\n') == 5
    assert docstring_lines("import os\n") == 0
