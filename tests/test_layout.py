"""The package's shape: subpackages in one import order (`fsdp_zero.LAYERS`), each with a public face
(docs/architecture.md renders both; tests/test_docs.py keeps it true).

Covers: fsdp_zero/api.py, fsdp_zero/errors.py
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from fsdp_zero import LAYERS

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "fsdp_zero"

# "": fsdp_zero itself (__version__)
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names} | {"": 0}
ROOT_FILES = {"__init__.py", "api.py", "errors.py", "torch_private.py"}
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")


def _home(module: str) -> str:
    """``fsdp_zero.sharding.build`` -> ``sharding``; ``fsdp_zero.errors`` -> ``errors``; ``fsdp_zero`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported fsdp_zero module, line, inside a function) for every in-package import of ``path``."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.ImportFrom)
                and child.level == 0
                and (child.module or "").startswith("fsdp_zero")
            ):
                targets = [child.module]
                # a submodule, or a name of the package itself (LAYERS)
                if child.module == "fsdp_zero":
                    targets = [
                        f"fsdp_zero.{a.name}"
                        if (PACKAGE / a.name).is_dir() or (PACKAGE / f"{a.name}.py").is_file()
                        else "fsdp_zero"
                        for a in child.names
                    ]
                found.extend((t, child.lineno, in_function) for t in targets)
            elif isinstance(child, ast.Import):
                found.extend(
                    (a.name, child.lineno, in_function)
                    for a in child.names
                    if a.name.startswith("fsdp_zero")
                )
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), False)
    return found


def _modules() -> list[tuple[Path, str]]:
    return [
        (p, p.relative_to(PACKAGE).parts[0].removesuffix(".py"))
        for p in sorted(PACKAGE.rglob("*.py"))
    ]


def test_the_root_holds_four_files_and_every_subpackage_has_a_level():
    assert {p.name for p in PACKAGE.glob("*.py")} == ROOT_FILES
    assert set(SUBPACKAGES) == set(LEVEL) - {"", *(f.removesuffix(".py") for f in ROOT_FILES)}, (
        SUBPACKAGES
    )


def test_imports_run_down_the_order_and_none_hides_in_a_function():
    """A module imports from its own subpackage or from a lower level, at the top of the module
    (an import inside a function hides a dependency; torch_private's lazy imports are for import time)."""
    upward, hidden = [], []
    for path, home in _modules():
        if home == "__init__":
            continue
        for target, line, in_function in _imports(path):
            where = f"{path.relative_to(REPO)}:{line} imports {target}"
            to = _home(target)
            if to != home and (to not in LEVEL or LEVEL[to] >= LEVEL[home]):
                upward.append(where)
            if in_function and to != "torch_private":
                hidden.append(where)
    assert upward == [], "imports up (or across) the order of fsdp_zero.LAYERS"
    assert hidden == []


def test_each_subpackage_has_a_face_that_names_what_it_exports():
    """``__init__.py`` re-exports the subpackage's API with ``__all__``: every name resolves, and
    every name it imports is in ``__all__``."""
    for sub in SUBPACKAGES:
        init = PACKAGE / sub / "__init__.py"
        assert init.is_file(), f"fsdp_zero/{sub} has no __init__.py"
        face = importlib.import_module(f"fsdp_zero.{sub}")
        exported = getattr(face, "__all__", None)
        assert exported, f"fsdp_zero/{sub}/__init__.py declares no __all__"
        assert len(set(exported)) == len(exported), sub
        assert all(hasattr(face, name) for name in exported), sub
        imported = {
            a.asname or a.name
            for n in ast.parse(init.read_text()).body
            if isinstance(n, ast.ImportFrom)
            for a in n.names
            if n.module != "__future__"
        }
        assert imported == set(exported), (
            f"fsdp_zero/{sub}: imported but not in __all__, or the other way round"
        )


def test_scripts_and_bench_import_only_faces():
    """``scripts/`` and ``bench/`` use the subpackages' faces (and the root's api and errors), never a
    module behind a face."""
    allowed = {f"fsdp_zero.{sub}" for sub in SUBPACKAGES} | {
        "fsdp_zero",
        "fsdp_zero.api",
        "fsdp_zero.errors",
    }
    past = []
    for path in sorted([*(REPO / "scripts").glob("*.py"), *(REPO / "bench").glob("*.py")]):
        past += [
            f"{path.relative_to(REPO)}:{line} imports {t}"
            for t, line, _ in _imports(path)
            if t not in allowed
        ]
    assert past == []


def test_every_source_mutant_still_finds_the_expression_it_replaces():
    """make mutants replaces one expression of our source per mutant (tests/mutant_site); a mutant whose
    expression moved or changed would not apply (NOT APPLIED after a 24-minute run): caught here at once."""
    site = ast.parse((REPO / "tests" / "mutant_site" / "source_mutants.py").read_text())
    table = next(
        n.value
        for n in site.body
        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SOURCE"
    )
    missing = []
    for name, entry in zip(table.keys, table.values):
        module, old, _ = (ast.literal_eval(e) for e in entry.elts)
        # a module's dotted name, or a script's path (scripts/x.py)
        path = REPO / (module if module.endswith(".py") else module.replace(".", "/") + ".py")
        if path.read_text().count(old) != 1:
            missing.append(f"{ast.literal_eval(name)}: {old!r} is not in {module} exactly once")
    assert missing == []


def test_only_the_schema_and_the_task_table_name_a_task():
    """What a task means is `fsdp_zero.model.tasks.TASKS`' row (and the schema's rules): no other module
    branches on a task."""
    named = []
    for path, _ in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("config/") or rel == "model/tasks.py":
            continue
        named += [
            f"{rel}:{n.lineno}"
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "Task"
        ]
    assert named == []


def test_the_code_is_formatted_and_lint_clean():
    """ruff format and ruff check (pyproject.toml's settings: code wrapped at 100, no line over 120) find
    nothing (`make format`), and under 2% of the package's lines run past 100 (the docstrings, comments
    and messages that may: wrap them)."""
    import subprocess
    import sys

    where = ["fsdp_zero", "scripts", "bench", "tests"]
    for check in (["format", "--check"], ["check"]):
        out = subprocess.run(
            [sys.executable, "-m", "ruff", *check, "--no-cache", *where],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, (
            f"ruff {' '.join(check)}: run `make format`\n{out.stdout[-3000:]}{out.stderr[-2000:]}"
        )
    lines = [line for path in PACKAGE.rglob("*.py") for line in path.read_text().splitlines()]
    long = [line for line in lines if len(line) > 100]
    assert len(long) < 0.02 * len(lines), f"{len(long)} of {len(lines)} lines over 100: {long[:5]}"
