"""Every code block of the README (and of docs/api.md and docs/guide.md) runs, so the documentation cannot rot.

The README's ```python blocks run as pasted: the first (the swap, which builds a stand-in model,
data and loss) in an empty namespace, as in a fresh interpreter, and every later one right after
it, in what the first left, so a reader who pasted the swap can paste any later block. The blocks
of docs/api.md and docs/guide.md run in a fresh namespace holding the names their text assumes:
`model`, `loader`, `loss_fn`, `device` (a tiny CPU stand-in for each), `torch`, `nn`, `F`,
`kfac_optim` and `KFAC`. An HTML comment right before a block changes that:
  `<!-- readme-test: autoencoder -->`  `model` and `loader` are a small regression (y = x);
  `<!-- readme-test: apex -->`         runs under the Apex stand-in (tests/apex_standin);
  `<!-- readme-test: excerpt of PATH -->` every line of the block occurs, in order, in PATH,
                                       a script that runs in the suite (tests/scripts/test_examples.py:
                                       the torchrun recipes on gloo ranks), and the block is not run;
                                       the README names PATH in its text.
In ```bash blocks, every `python -m MODULE` and `torchrun ... -m MODULE` names a module that exists
(the commands themselves run, on tiny settings, in tests/scripts/test_examples.py and test_train_script.py).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest_apex import install_fake_apex
from torch import nn

import kfac_optim

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = (README, ROOT / "docs" / "api.md", ROOT / "docs" / "guide.md")
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<directive>[^>]*?) -->\n)?```(?P<lang>\w+)\n(?P<code>.*?)```", re.S)


def blocks(lang: str, path: Path = README) -> list[tuple[str, str, str]]:
    """``(directive, code, "file:line")`` of every ``lang`` block of the document at ``path``."""
    text = path.read_text(encoding="utf-8")
    return [(m["directive"] or "", m["code"], f"{path.name}:{text.count(chr(10), 0, m.start('code')) + 1}")
            for m in BLOCK.finditer(text) if m["lang"] == lang]


SECOND_OPTIMIZER = "the model already has a live KFAC optimizer"  # a block pasted after the swap builds another
PYTHON = [block for path in DOCS for block in blocks("python", path)]
PYTHON_CASES = [pytest.param(*block, id=block[2], marks=[pytest.mark.apex] if block[0] == "apex" else [])
                for block in PYTHON]  # an "apex" block runs against the Apex stand-in: marked `apex`


def stand_ins(directive: str) -> dict[str, Any]:
    torch.manual_seed(0)
    if directive == "autoencoder":
        model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 8))
        loader = [(x, x) for x in torch.randn(3, 16, 8)]
    else:
        model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))
        loader = [(torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))) for _ in range(3)]
    return {"model": model, "loader": loader, "loss_fn": F.cross_entropy, "device": "cpu", "torch": torch,
            "nn": nn, "F": F, "kfac_optim": kfac_optim, "KFAC": kfac_optim.KFAC}


def pasted_after_the_swap() -> dict[str, Any]:
    """What a fresh interpreter holds once the README's first ```python block (the swap) is pasted."""
    torch.manual_seed(0)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    _, code, line = blocks("python")[0]
    exec(compile(code, line, "exec"), namespace)  # noqa: S102 (the documentation's own code)
    return namespace


def test_the_readme_has_the_blocks_this_test_knows() -> None:
    directives = [directive for directive, _, _ in PYTHON]
    assert len(blocks("python")) >= 7 and len(PYTHON) >= 10
    assert {"", "autoencoder", "apex"} <= set(directives)
    assert any(d.startswith("excerpt of ") for d in directives)
    assert {d for d in directives if not d.startswith("excerpt of ")} <= {"", "autoencoder", "apex"}
    readme = blocks("python")
    assert readme[0][0] == "" and all(d == "" or d.startswith("excerpt of ") for d, _, _ in readme)  # as pasted
    text = README.read_text(encoding="utf-8")
    assert all(d.removeprefix("excerpt of ") in text.replace(f"<!-- readme-test: {d} -->", "")
               for d, _, _ in readme if d)  # an excerpt names its script where the reader sees it


@pytest.mark.parametrize(("directive", "code", "line"), PYTHON_CASES)
def test_python_block_runs(directive: str, code: str, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if directive.startswith("excerpt of "):
        source = (ROOT / directive.removeprefix("excerpt of ")).read_text(encoding="utf-8").splitlines()
        lines = iter(text.strip() for text in source)
        missing = [text for text in (c.strip() for c in code.splitlines()) if text and text not in lines]
        assert missing == [], f"{line}: not in {directive} (in this order)"
        return
    if directive == "apex":
        install_fake_apex(monkeypatch)
    if line == blocks("python")[0][2]:
        namespace: dict[str, Any] = {"__name__": "__main__"}  # a fresh interpreter
    elif line.startswith(f"{README.name}:"):
        namespace = pasted_after_the_swap()
    else:
        namespace = stand_ins(directive)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(code, line, "exec"), namespace)  # noqa: S102 (the documentation's own code)
    if line.startswith(f"{README.name}:"):  # pasted, a README block warns only that it replaces the swap's optimizer
        assert [str(w.message) for w in caught if not str(w.message).startswith(SECOND_OPTIMIZER)] == []
    if "optimizer" in namespace:  # what the block built is a KFAC (Apex returns it, patched)
        assert isinstance(namespace["optimizer"], kfac_optim.KFAC)


def test_every_module_a_readme_command_runs_exists() -> None:
    modules = []
    for _, code, _ in (block for path in DOCS for block in blocks("bash", path)):
        for command in code.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            if words[:1] in (["python"], ["torchrun"]) and "-m" in words:
                modules.append(words[words.index("-m") + 1])
    assert {"benchmarks.digits", "examples.train"} <= set(modules)
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
