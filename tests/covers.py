"""Which test files cover which package module, read from each tests/test_*.py docstring's ``Covers:`` line.

A test file's docstring ends with the modules it tests, by path from the repository root::

    Covers: fsdp_zero/sharding/tensor.py, fsdp_zero/sharding/pipeline.py

(continued on indented lines when long). `index` turns them round into docs/testing.md's table, a row per
module (scripts/docs.py's ``tests-index`` block; tests/test_docs.py keeps it current). Standard library
only: scripts/docs.py runs this file by its path.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# "Covers:" and its continuation lines (indented), up to the first line that is neither
_COVERS = re.compile(r"^Covers: ([^\n]*(?:\n[ \t]+[^\n]*)*)", re.M)


def covers(path: Path) -> list[str]:
    """The modules a test file's docstring names on its ``Covers:`` line (none: no such line)."""
    found = _COVERS.search(ast.get_docstring(ast.parse(path.read_text())) or "")
    return [m.strip() for m in found.group(1).split(",")] if found else []


def index(repo: Path = REPO) -> str:
    """A markdown table: each package module (``__init__.py`` files left out) and the test files that
    name it, or "none"."""
    by_module: dict[str, list[str]] = {}
    for path in sorted((repo / "tests").glob("test_*.py")):
        for module in covers(path):
            by_module.setdefault(module, []).append(f"`{path.relative_to(repo).as_posix()}`")
    rows = ["| module | tested in |", "|---|---|"]
    for path in sorted((repo / "fsdp_zero").rglob("*.py")):
        module = path.relative_to(repo).as_posix()
        if path.name != "__init__.py":
            rows.append(f"| `{module}` | {', '.join(by_module.get(module, [])) or 'none'} |")
    return "\n".join(rows)
