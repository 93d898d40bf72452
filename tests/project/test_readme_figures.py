"""The README's "When K-FAC pays" table quotes what its result files say.

Each row of the table quotes figures (time ratios, step ratios, counts such as ``7/9``) and links the
result file or folder they came from under benchmarks/results/. Each test here reads one row (found by
its first cell and its link), recomputes its figures from that link's data (the JSON or metrics files
next to the linked Markdown) the way the row states them, and checks that the row prints exactly those
figures, rounded as it prints them. A re-run that moves a figure fails here, naming the row and the
figure, until the README follows.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class PaysRow:
    """One row of the table: its task (a continuation row's is the row above's), cells and link."""

    task: str
    goal: str
    time: str
    step: str
    link: str


def pays_rows() -> list[PaysRow]:
    """The rows of the README's "When K-FAC pays" table, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## When K-FAC pays", 1)[1].split("\n## ", 1)[0]
    rows: list[PaysRow] = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 5 or set(cells[0]) <= {"-"} and cells[0]:
            continue
        link = re.search(r"\]\(([^)]+)\)", cells[4])
        if link is None:  # the header
            continue
        task = cells[0] or rows[-1].task
        rows.append(PaysRow(task, cells[1], cells[2], cells[3], link[1]))
    return rows


def pays_row(task_start: str, link: str) -> PaysRow:
    """The one row whose task starts with ``task_start`` and whose link is ``link``."""
    found = [r for r in pays_rows() if r.task.startswith(task_start) and r.link == link]
    assert len(found) == 1, f"README 'When K-FAC pays': {len(found)} rows start with {task_start!r} and link {link}"
    return found[0]


def assert_row_quotes(row: PaysRow, cell: str, pattern: str, want: tuple[str, ...], figure: str) -> None:
    """That ``row``'s ``cell`` (``"time"``, ``"step"``, ...) matches ``pattern`` and its groups are ``want``."""
    text = getattr(row, cell)
    match = re.search(pattern, text)
    assert match is not None, f"README row {row.task!r}: {figure}: the {cell} cell {text!r} no longer reads {pattern!r}"
    assert match.groups() == want, (f"README row {row.task!r}: {figure}: the README says {match.groups()}, "
                                    f"the data behind {row.link} gives {want}")


def read_result(path: str) -> object:
    return json.loads((RESULTS / path).read_text(encoding="utf-8"))


# -- the 1-D CNN at three batches (benchmarks.large_batch) ---------------------------------------------

def test_the_large_batch_row_quotes_large_batch_json() -> None:
    row = pays_row("1-D CNN", "benchmarks/results/large_batch_3seeds/large_batch.md")
    data = read_result("large_batch_3seeds/large_batch.json")
    rows = {(r["optimizer"], r["batch"]): r for r in data["tasks"]["cnn"]["rows"]}
    batches, seeds = data["settings"]["batches"], data["settings"]["seeds"]
    assert_row_quotes(row, "task", r"^1-D CNN, batch (\d+) / (\d+) / (\d+) .*, (\d+) seeds",
                      (*map(str, batches), str(seeds)), "the batches and seeds")
    assert_row_quotes(row, "goal", r"^(\d+%) test accuracy$", (f"{data['tasks']['cnn']['target']:.0%}",), "the target")

    def time_ratios(name: str, base: str) -> tuple[str, ...]:  # median CPU seconds to the target over the seeds
        return tuple(f"{statistics.median(rows[name, b]['seconds']) / statistics.median(rows[base, b]['seconds']):.2f}"
                     for b in batches)

    def step_ratios(name: str, base: str) -> tuple[str, ...]:
        return tuple(f"{rows[name, b]['step_ms'] / rows[base, b]['step_ms']:.1f}" for b in batches)

    three = r"([\d.]+)× / ([\d.]+)× / ([\d.]+)×"
    assert_row_quotes(row, "time", rf"drop-in {three} SGD's", time_ratios("kfac_dropin", "sgd"),
                      "drop-in's time to the target over SGD's")
    assert_row_quotes(row, "time", rf"EigenAdam {three} AdamW's", time_ratios("kfac", "adamw"),
                      "EigenAdam's time to the target over AdamW's")
    assert_row_quotes(row, "step", rf"^{three}; {three}$",
                      step_ratios("kfac_dropin", "sgd") + step_ratios("kfac", "adamw"),
                      "drop-in's step over SGD's; EigenAdam's over AdamW's")
    soap_fewer = all(statistics.median(rows["soap", b]["steps"]) < statistics.median(rows["kfac", b]["steps"])
                     for b in batches)
    assert ("SOAP needs fewer steps" in row.time) == soap_fewer, \
        f"README row {row.task!r}: 'SOAP needs fewer steps' (than EigenAdam at every batch) is {soap_fewer} in the file"
