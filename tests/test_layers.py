"""The package's import graph: no cycle anywhere, entry points on top, models free of the package.

import-linter (`make lint`, contracts in pyproject.toml) checks the layers; this test adds what its
contracts do not state: no module of the package takes part in an import cycle, at any depth (also inside
one folder), and the entry points import only the orchestration and inference layers.
"""

from __future__ import annotations

import ast
import importlib.util
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


def test_the_module_map_is_the_modules_own_first_docstring_sentences():
    """docs/architecture.md's map is what scripts/module_map.py makes of the tree: every module, each with
    its docstring's first sentence, and nothing else (a new module needs the command, not a hand edit)."""
    spec = importlib.util.spec_from_file_location("module_map", REPO_ROOT / "scripts" / "module_map.py")
    module_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module_map)
    text = module_map.module_map()
    modules = {
        str(p.relative_to(REPO_ROOT / "ssd_lightning"))
        for p in (REPO_ROOT / "ssd_lightning").rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    listed = [line.split()[0] for line in text.splitlines() if line.split()[0].endswith(".py")]
    assert len(listed) == len(modules) + 2  # and train.py, predict.py
    assert "    predict.py           Detect objects in image files" in text  # a module of a package, indented
    documented = (REPO_ROOT / "docs" / "architecture.md").read_text()
    assert "```text\n" + text + "```" in documented, (
        "docs/architecture.md's module map is not current: run python scripts/module_map.py"
    )
