"""docs/architecture.md's "Layout" names every module of ``src/kfac_optim`` and no module that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "kfac_optim"


def layout_modules() -> set[str]:
    """The package's files as the layout block lists them: ``"optimizer.py"``, ``"layers/base.py"``."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = text.index("\n## Layout\n")
    section = text[start : text.index("\n## ", start + 1)]
    block = section[section.index("```") + 3 :]
    block = block[: block.index("```")]
    names: set[str] = set()
    inside, folder = False, ""
    for line in block.splitlines():
        match = re.match(r"^( *)(\S+)", line)
        if match is None:
            continue
        indent, name = len(match.group(1)), match.group(2)
        if indent == 0:
            inside = name == "src/kfac_optim/"
            continue
        if not inside or indent > 4 or not re.fullmatch(r"[\w.]+/?", name):
            continue  # a description's continuation line
        if indent == 2:
            folder = name if name.endswith("/") else ""
            if not folder:
                names.add(name)
        else:
            names.add(folder + name)
    return names


def test_the_layout_in_architecture_md_lists_exactly_the_package_modules() -> None:
    on_disk = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if not (path.name == "__init__.py" and path.parent != PACKAGE)
    }
    listed = layout_modules()
    assert sorted(on_disk - listed) == [], "modules missing from docs/architecture.md's layout"
    assert sorted(listed - on_disk) == [], "docs/architecture.md's layout names modules that do not exist"
