"""The library's warnings and errors recommend settings as they are spelled now.

A message that tells the user what to pass names the config field (``KFAC(...,
runtime=RuntimeConfig(grad_scaler=scaler))``), never a flat keyword of an earlier release
(``KFAC(..., grad_scaler=scaler)``, which works only with a ``DeprecationWarning``): a scan of the
literal text of every call's arguments in src/ (warnings, log records, exceptions).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kfac_optim.config import FLAT_KEYWORDS


def deprecated_spellings(text: str) -> list[str]:
    """Each flat keyword ``old=`` in ``text`` that is not spelled as its config's field: inside
    ``CurvatureConfig(...)``/``AsyncConfig(...)``/``RuntimeConfig(...)``, or as ``Config.field=``."""
    found = []
    for match in re.finditer(r"(?<![\w.])(" + "|".join(FLAT_KEYWORDS) + r")=", text):
        if not re.search(r"(Curvature|Async|Runtime)Config\([^()]*$", text[: match.start()]):
            found.append(match.group(0))
    return found


def message_text(node: ast.AST) -> str:
    """The literal text of a message argument (the constant parts of an f-string, ``...`` for the rest)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "..." for v in node.values)
    if isinstance(node, ast.BinOp):
        return message_text(node.left) + message_text(node.right)
    return ""


def test_the_library_s_warnings_and_errors_recommend_the_current_spelling() -> None:
    """Every message the library warns, logs or raises names settings as they are spelled now
    (``KFAC(..., runtime=RuntimeConfig(grad_scaler=scaler))``, not the deprecated ``grad_scaler=``)."""
    root = Path(__file__).parents[2] / "src" / "kfac_optim"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                text = " ".join(message_text(arg) for arg in node.args)
                offenders += [f"{path.relative_to(root)}:{node.lineno}: {s}" for s in deprecated_spellings(text)]
    assert offenders == []


def test_the_spelling_scan_tells_current_from_deprecated() -> None:
    assert deprecated_spellings("Pass KFAC(..., grad_scaler=scaler).") == ["grad_scaler="]
    assert deprecated_spellings("use async_statistics=False") == ["async_statistics="]
    assert deprecated_spellings("Pass KFAC(..., runtime=RuntimeConfig(grad_scaler=scaler)).") == []
    assert deprecated_spellings("RuntimeConfig(process_group=..., grad_worker_fraction=1)") == []
    assert deprecated_spellings("got RuntimeConfig.grad_worker_fraction=0.3") == []
