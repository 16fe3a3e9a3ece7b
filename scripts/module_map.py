"""Rewrite the module map in docs/architecture.md from the modules themselves.

    python scripts/module_map.py            # after adding, removing or re-describing a module
    python scripts/module_map.py --check    # exit 1 if the map is stale (what tests/test_layers.py checks)

One line per module: its path in the tree and the first sentence of its docstring (Sphinx roles and
double backquotes made plain, cut at 100 characters); a package's line is its ``__init__.py``'s.
Packages come in the order of the layers, top first (``LAYERS``; any other package after them), their
modules alphabetically, then the top-level modules of the package.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
LAYERS = ["cli", "inference", "modules", "callbacks", "data", "models", "io"]
WIDTH = 100


def summary(path: Path) -> str:
    """The first sentence of ``path``'s module docstring, on one line, at most ``WIDTH`` characters."""
    text = " ".join((ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").split())
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([\w]+)`", r"\1", text).replace("``", "`")  # :func:`~a.b` -> b
    sentence = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0].rstrip(".")
    if not sentence:
        raise SystemExit(
            f"{path.relative_to(REPO)}: no module docstring; its first sentence is its map entry"
        )
    return sentence if len(sentence) <= WIDTH else sentence[: WIDTH - 3].rsplit(" ", 1)[0] + " ..."


def _line(indent: int, name: str, path: Path) -> str:
    return f"{' ' * indent}{name:<{max(25 - indent, len(name) + 2)}}{summary(path)}"


def module_map() -> str:
    """The map's text: entry points, then the package by layers."""
    package = REPO / "ssd_lightning"
    lines = [_line(0, name, REPO / name) for name in ("train.py", "predict.py")]
    lines.append(_line(0, "ssd_lightning/", package / "__init__.py"))
    subpackages = sorted(p.name for p in package.iterdir() if (p / "__init__.py").is_file())
    for name in sorted(subpackages, key=lambda n: (LAYERS.index(n) if n in LAYERS else len(LAYERS), n)):
        lines.append(_line(2, f"{name}/", package / name / "__init__.py"))
        lines += [
            _line(4, p.name, p) for p in sorted((package / name).glob("*.py")) if p.name != "__init__.py"
        ]
    lines += [_line(2, p.name, p) for p in sorted(package.glob("*.py")) if p.name != "__init__.py"]
    return "\n".join(lines) + "\n"


def _split(doc: str) -> tuple[str, str, str]:
    """docs/architecture.md as (before the map's text, the map's text, after it)."""
    head, rest = doc.split("## Module map", 1)
    start = rest.index("```text\n") + len("```text\n")
    end = rest.index("```", start)
    return head + "## Module map" + rest[:start], rest[start:end], rest[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the map is not current; write nothing"
    )
    args = parser.parse_args(argv)
    before, current, after = _split(DOC.read_text(encoding="utf-8"))
    wanted = module_map()
    if current == wanted:
        print(f"{DOC.relative_to(REPO)}: the module map is current")
        return 0
    if args.check:
        print(f"{DOC.relative_to(REPO)}: the module map is stale; run python scripts/module_map.py")
        return 1
    DOC.write_text(before + wanted + after, encoding="utf-8")
    print(f"{DOC.relative_to(REPO)}: module map rewritten ({wanted.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
