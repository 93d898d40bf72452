"""The package's modules import each other without a cycle (docs/design.md §2: arrows point one way).

Reads the sources with ``ast`` (nothing is imported): every ``import kfac_optim...`` and
``from ... import ...`` of a ``kfac_optim`` module, absolute or relative, at any depth (inside
functions and ``if TYPE_CHECKING:`` blocks too: a type-only import is still a dependency). An
edge goes to the module named, and to each submodule imported from a package
(``from kfac_optim.layers import conv``); a name imported from a package (``from kfac_optim.layers
import KroneckerBlock``) is an edge to the package's ``__init__``. Run as a script to print the graph's cycles.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "kfac_optim"
SOURCE = Path(__file__).resolve().parents[2] / "src" / PACKAGE


def module_files(root: Path = SOURCE) -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of the package (a package is its ``__init__``)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from`` import names (relative ones resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules ``module`` (source at ``path``) imports, at any depth of its code."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, module, is_package)
            submodules = {f"{target}.{alias.name}" for alias in node.names} & modules
            found |= submodules
            if target in modules and len(submodules) < len(node.names):
                found.add(target)
    found.discard(module)
    return found


def import_graph(root: Path = SOURCE) -> dict[str, set[str]]:
    """``{module: the package modules it imports}``."""
    files = module_files(root)
    return {module: imports_of(module, path, set(files)) for module, path in files.items()}


def components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (each holds a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[m0, m1, ..., m0]`` per strongly connected component of more than one module."""
    return [_cycle_in(graph, component) for component in components(graph)]


def cycle_report(graph: dict[str, set[str]]) -> str:
    """One line per cycle, with every module of its strongly connected component."""
    lines = []
    for component in components(graph):
        cycle = _cycle_in(graph, component)
        lines.append(" -> ".join(cycle) + f"   (modules on cycles with it: {', '.join(sorted(component))})")
    return "\n".join(lines)


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first (sorted) module of a strongly connected ``component``."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if succ not in parents:
                    parents[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def test_the_walk_sees_every_kind_of_import(tmp_path: Path) -> None:
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from kfac_optim.sub import thing\n")
    (package / "sub" / "__init__.py").write_text("thing = 1\n")
    (package / "sub" / "deep.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import top\n"
    )
    (package / "top.py").write_text("def f():\n    import kfac_optim.sub.deep\n")
    (package / "other.py").write_text("from .sub import deep, thing\n")
    graph = import_graph(package)
    assert graph == {
        "kfac_optim": {"kfac_optim.sub"},
        "kfac_optim.sub": set(),
        "kfac_optim.sub.deep": {"kfac_optim.top"},
        "kfac_optim.top": {"kfac_optim.sub.deep"},
        "kfac_optim.other": {"kfac_optim.sub", "kfac_optim.sub.deep"},
    }
    assert cycles(graph) == [["kfac_optim.sub.deep", "kfac_optim.top", "kfac_optim.sub.deep"]]


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 20, sorted(graph)  # the walk found the package
    assert not components(graph), "import cycles:\n" + cycle_report(graph)



def test_the_optimizer_leaves_the_step_length_to_its_owner() -> None:
    """``optimizer.py`` hands the step's length to ``step_length.py``, which alone touches FSDP2's
    shards for it (the optimizer does not reach into ``distributed.fsdp`` for the KL clip)."""
    graph = import_graph()
    assert "kfac_optim.distributed.fsdp" not in graph["kfac_optim.optimizer"]
    assert "kfac_optim.update.step_length" in graph["kfac_optim.optimizer"]


if __name__ == "__main__":
    graph = import_graph()
    if components(graph):
        print(cycle_report(graph))
        sys.exit(1)
