"""The package's import graph: no cycle anywhere, entry points on top, models free of the package.

import-linter (`make lint`, contracts in pyproject.toml) checks the layers; this test adds what its
contracts do not state: no module of the package takes part in an import cycle, at any depth (also inside
one folder), and the entry points import only the orchestration and inference layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

from tests.helpers import REPO_ROOT

pytestmark = pytest.mark.no_dali


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative), or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph.find_modules_directly_imported_by(node):
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = grimp.ImportGraph()
    for name in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    graph.add_import(importer="p.d", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_import_cycle_in_the_package():
    graph = grimp.build_graph("ssd_lightning")
    assert _cycles(graph) == []


def _package_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ssd_lightning"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("ssd_lightning"))
    return names


@pytest.mark.parametrize(
    ("entry_point", "layer"), [("train.py", "ssd_lightning.cli"), ("predict.py", "ssd_lightning.inference")]
)
def test_entry_points_import_only_their_layer(entry_point, layer):
    imported = _package_imports(REPO_ROOT / entry_point)
    assert imported, f"{entry_point} imports nothing of the package"
    assert all(name.startswith(layer) for name in imported), imported


def test_nothing_in_the_package_imports_an_entry_point():
    for path in (REPO_ROOT / "ssd_lightning").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {a.name for a in node.names} & {"train", "predict"}, path
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module not in ("train", "predict"), path


def _module_map() -> set[str]:
    """Paths named in docs/architecture.md's module map (folders by indentation, two spaces a level)."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    paths, folders = set(), []
    for line in block.splitlines():
        name = line.strip().split(" ", 1)[0]
        if not name:
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        paths.add("/".join([*folders, name.rstrip("/")]))
    return paths


def test_the_module_map_names_every_module_and_nothing_else():
    named = {p for p in _module_map() if p.endswith(".py")}
    tree = {
        str(p.relative_to(REPO_ROOT))
        for p in (REPO_ROOT / "ssd_lightning").rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    tree |= {"train.py", "predict.py"}
    assert not tree - named, f"modules missing from docs/architecture.md's module map: {sorted(tree - named)}"
    assert not named - tree, f"the module map names files that do not exist: {sorted(named - tree)}"
