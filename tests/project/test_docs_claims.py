"""What the documents say about the code and about each other holds (docs/design.md §2).

- The package imports neither ``examples`` nor ``benchmarks``.
- architecture.md's layout names every public name of ``kfac_optim.__all__``.
- Every citation of a design.md section (``design.md §4.1``) names a section that exists, and every
  citation of a named part of a document (``benchmarks/RESULTS.md, "Step time"``, ``docs/design.md
  §4, "Compiled models"``, ``docs/numerics.md, "What N is"``) names a heading or a bold
  lead-in of that document (of that section, when one is given).
- Every relative Markdown link of the README and the documents points at a file that exists and,
  with ``#anchor``, at one of its headings.
- The README stays a five-minute read.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import kfac_optim

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src" / "kfac_optim"
DOCUMENTS = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "RESULTS.md",
             *sorted((ROOT / "docs").glob("*.md"))]
CITING = [*DOCUMENTS, *sorted(SOURCE.rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
          *sorted((ROOT / "benchmarks").rglob("*.py")), *sorted((ROOT / "examples").rglob("*.py"))]
NAMED = {"README": "README.md", "RESULTS.md": "benchmarks/RESULTS.md", "api.md": "docs/api.md",
         "design.md": "docs/design.md", "tuning.md": "docs/tuning.md", "guide.md": "docs/guide.md",
         "transformer_diagnosis.md": "docs/transformer_diagnosis.md", "numerics.md": "docs/numerics.md",
         "architecture.md": "docs/architecture.md"}
CITATION = re.compile(r"(README|(?:[\w/]*/)?"
                      r"(?:RESULTS|api|design|tuning|guide|transformer_diagnosis|numerics|architecture)\.md)"
                      r"(?:,?\s+§(?P<section>\d+(?:\.\d+)?))?,?\s+[\"“](?P<name>[^\"”\n]{3,80})[\"”]")
SECTION = re.compile(r"design\.md\s+§(\d+(?:\.\d+)?)")


def headings(path: Path) -> list[tuple[int, str]]:
    """``(line index, heading text)`` of a Markdown file's headings, fenced blocks left out."""
    found, fenced = [], False
    for index, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.*)", line)):
            found.append((index, match[1].strip()))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def design_sections() -> set[str]:
    return {m[1] for _, text in headings(ROOT / "docs" / "design.md") if (m := re.match(r"(\d+(?:\.\d+)?)\.? ", text))}


def test_the_package_imports_neither_examples_nor_benchmarks() -> None:
    offenders = []
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.split(".")[0] in ("examples", "benchmarks")]
    assert offenders == []


def test_the_layout_names_every_public_name() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    entry = text[text.index("  __init__.py"):text.index("  optimizer.py")]
    words = set(re.findall(r"[\w]+", entry))
    assert sorted(set(kfac_optim.__all__) - words) == []


def test_every_cited_design_section_exists() -> None:
    sections = design_sections()
    assert {"2", "3", "4", "4.1", "5", "6", "7", "8"} <= sections
    missing = [f"{path.relative_to(ROOT)}: §{number}" for path in CITING
               for number in SECTION.findall(path.read_text(encoding="utf-8")) if number not in sections]
    assert missing == []


@functools.cache
def _named_parts(path: Path, section: str | None) -> list[str]:
    """The headings and bold lead-ins of ``path`` (of design.md's ``section`` when given)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start, end = 0, len(lines)
    if section is not None:
        marks = headings(path)
        for i, (index, text) in enumerate(marks):
            if text.startswith(f"{section}. ") or text.startswith(f"{section} "):
                start = index
                top = re.match(r"\d+", section)[0]
                end = next((j for j, t in marks[i + 1:] if re.match(r"\d+\. ", t) and not t.startswith(f"{top}.")),
                           len(lines))
                break
    names = [text for index, text in headings(path) if start <= index < end]
    names += re.findall(r"(?<![\w*])\*\*([^*\n]+?)\.?\*\*(?![\w*])", "\n".join(lines[start:end]))
    return [n.strip("`") for n in names]


def test_every_cited_part_of_a_document_exists() -> None:
    missing = []
    for path in CITING:
        text = path.read_text(encoding="utf-8")
        for match in CITATION.finditer(text):
            name = match[1].rsplit("/", 1)[-1] if match[1] != "README" else "README"
            target = ROOT / NAMED[name]
            wanted = match["name"].rstrip(".,")
            parts = _named_parts(target, match["section"] if name == "design.md" else None)
            if not any(part.startswith(wanted) or wanted.startswith(part) and len(part) > 8 for part in parts):
                line = text.count("\n", 0, match.start()) + 1
                missing.append(f"{path.relative_to(ROOT)}:{line}: {match[0]!r}")
    assert missing == [], "\n".join(missing)


def test_every_relative_link_resolves() -> None:
    broken = []
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):
                continue  # an external address
            file, _, anchor = link.partition("#")
            target = (path.parent / file).resolve() if file else path
            if not target.exists():
                broken.append(f"{path.relative_to(ROOT)}: {link}")
            elif anchor and target.suffix == ".md" and anchor not in {slug(h) for _, h in headings(target)}:
                broken.append(f"{path.relative_to(ROOT)}: {link} (no such heading)")
    assert broken == []


def test_the_readme_is_a_five_minute_read() -> None:
    """At most 250 lines, the optimizer in use within the first 60; the rest lives in docs/."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250
    assert any("KFAC(" in line for line in lines[:60])
