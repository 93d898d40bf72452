"""Tests and documents state what holds now: no issue numbers, no "before the fix" stories.

History belongs to CHANGELOG.md. benchmarks/RESULTS.md keeps the record of each run, dated, and
names no issue either (nor the tables the benchmarks write beside it, nor the code). A test's
comment or docstring that names an issue or retells the failure it once caught goes stale with
the next change; the assertion is the specification.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HISTORY = re.compile(
    r"\bissues?\s+#?\d+"            # "issue 27", "issues 21", "Issue #5"
    r"|(?<![\w&/#])#\d+\b"          # "#27" (not an HTML entity, a URL fragment or a Markdown anchor)
    r"|\bbefore (?:the fix|issue)\b"
    r"|\buntil issue\b"
    r"|^\s*# Today:",               # a test's comment quoting how it failed on older code
    re.IGNORECASE | re.MULTILINE,
)


def history_mentions(text: str) -> list[str]:
    """``"line: text"`` of every place in ``text`` that tells history instead of the present."""
    return [f"{text.count(chr(10), 0, m.start()) + 1}: {m[0].strip()}" for m in HISTORY.finditer(text)]


def scanned_paths() -> list[Path]:
    """Every document but CHANGELOG.md, the results the benchmarks write, the tests and the code."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md")),
            *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "src").rglob("*.py")),
            *sorted((ROOT / "benchmarks").rglob("*.py")), *sorted((ROOT / "examples").rglob("*.py")),
            *sorted((ROOT / "configs").rglob("*.yaml"))]


def test_the_scan_covers_the_results_log_and_the_generated_tables() -> None:
    names = {path.relative_to(ROOT).as_posix() for path in scanned_paths()}
    assert {"benchmarks/RESULTS.md", "benchmarks/results/peers/peers.md", "benchmarks/peers/cli.py",
            "src/kfac_optim/optimizer.py", "examples/train.py", "configs/digits.yaml"} <= names
    assert "CHANGELOG.md" not in names


def test_no_test_or_document_names_an_issue_or_tells_history() -> None:
    paths = scanned_paths()
    offenders = [f"{path.relative_to(ROOT)}:{mention}" for path in paths if path != Path(__file__).resolve()
                 for mention in history_mentions(path.read_text(encoding="utf-8"))]
    assert offenders == [], "\n".join(offenders)


def test_the_scan_finds_history_and_leaves_the_present_alone() -> None:
    found = history_mentions('"""Eval mode records (issue 26)."""\n# Today: "assert 0 == 12"\nsee #27\n'
                             "# Before the fix: every G differs\nas before issue 26\n")
    assert [line.split(": ", 1)[0] for line in found] == ["1", "2", "3", "4", "5"]
    assert history_mentions("[the guide](guide.md#3-numerical-conventions) &#8212; color #1f77b4, step 27, "
                            "the fix names the argument\n") == []
