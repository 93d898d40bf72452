"""Where a benchmark's results go: ``<out>/<name>.json`` and a plot ``<out>/<name>.png`` next to it; and, for
a study made of searches (``benchmarks.zoo``, ``benchmarks.large_batch``), the JSON that an interrupted run
resumes from and that pieces of a run are joined by.

A resumable JSON holds ``settings`` (the run's arguments) and its finished searches, grouped
``{group: {search: record}}`` (a zoo model's optimizers; a large-batch task's optimizer-and-batch
searches). It is written whole after each search (:func:`write_json_whole`); a rerun reads it back
(:func:`load_finished`) only if it was made with the same values of the settings that change a run, and
skips the searches it holds; :func:`join_searches` joins the searches of several such files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

Searches = dict[str, dict[str, Any]]
"""Finished searches, ``{group: {search: record}}``."""


def write_json_and_plot(out: Path, name: str, payload: Any, figure: Figure) -> None:
    """Write ``payload`` (JSON-serializable) and ``figure`` into the folder ``out`` (made if missing); say where."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, plot_path = out / f"{name}.json", out / f"{name}.png"
    json_path.write_text(json.dumps(payload, indent=1))
    figure.savefig(plot_path, dpi=120)
    print(f"wrote {json_path} and {plot_path}")  # noqa: T201 (a command-line report)


def write_json_whole(path: Path, payload: Any) -> None:
    """``payload`` into ``path`` whole or not at all (a temporary file renamed over it); objects JSON
    lacks (a ``Path``) as their ``str``, non-finite floats as JSON's ``Infinity``/``NaN``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(payload, indent=1, default=str))
    partial.replace(path)


def load_finished(path: Path, settings: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any] | None:
    """The payload saved in ``path`` (None if there is none) when its ``settings`` agree with ``settings`` on
    every one of ``keys`` (compared as ``str``); a ``ValueError`` naming those that differ otherwise."""
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    differ = [k for k in keys if str(saved["settings"].get(k)) != str(settings[k])]
    if differ:
        raise ValueError(f"{path} holds runs with other {differ}; pass the same values or another --out")
    return saved


def join_searches(into: Searches, more: Searches) -> list[str]:
    """Add the searches of ``more`` to ``into``; if any is in both, add none and return them as
    ``"group/search"`` (empty: joined)."""
    twice = [f"{group}/{name}" for group, records in more.items() for name in records if name in into.get(group, {})]
    if not twice:
        for group, records in more.items():
            into.setdefault(group, {}).update(records)
    return twice
