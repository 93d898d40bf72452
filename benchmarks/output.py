"""Where a benchmark's results go: ``<out>/<name>.json`` and a plot ``<out>/<name>.png`` next to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure


def write_json_and_plot(out: Path, name: str, payload: Any, figure: Figure) -> None:
    """Write ``payload`` (JSON-serializable) and ``figure`` into the folder ``out`` (made if missing); say where."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, plot_path = out / f"{name}.json", out / f"{name}.png"
    json_path.write_text(json.dumps(payload, indent=1))
    figure.savefig(plot_path, dpi=120)
    print(f"wrote {json_path} and {plot_path}")  # noqa: T201 (a command-line report)
