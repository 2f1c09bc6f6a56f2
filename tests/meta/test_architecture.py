"""The architecture map is complete: every product module has a row in docs/ARCHITECTURE.md's "Where
each feature lives" tables, every row names a module that exists, and every package's docstring
names each of its modules. Reads files only (nothing is imported), so it runs in milliseconds."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "strata"  # the package `strata`, every subpackage inside it
MAP = ROOT / "docs" / "ARCHITECTURE.md"
SECTION = "## Where each feature lives"
NOT_MODULES = {"__init__.py", "__main__.py"}

HEADING = re.compile(
    r"^\*\*`(strata(?:\.\w+)*)`"
)  # **`strata.parallel`** or **`strata` (strata/)**
NAMED = re.compile(r"`([\w.]+)`")


def packages() -> dict[str, Path]:
    """{dotted name: folder} of `strata` and every package under it (a folder without an
    __init__.py is not a package and is not entered)."""
    found: dict[str, Path] = {}
    for folder, dirs, _ in os.walk(PACKAGE):
        path = Path(folder)
        if not (path / "__init__.py").is_file():
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found[".".join(("strata", *path.relative_to(PACKAGE).parts))] = path
    return found


def children(folder: Path) -> list[str]:
    """The names of a package's modules and subpackages, without __init__ and __main__."""
    modules = [p.stem for p in folder.glob("*.py") if p.name not in NOT_MODULES]
    subpackages = [p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    return sorted(modules + subpackages)


def product_modules() -> list[str]:
    """Every product module's dotted name (strata.parallel.zero, strata.plan.memory, ...)."""
    return sorted(
        f"{package}.{p.stem}"
        for package, folder in packages().items()
        for p in folder.glob("*.py")
        if p.name not in NOT_MODULES
    )


def mapped() -> dict[str, int]:
    """{dotted module name: line number} of every module the map's tables name in a row's first
    cell, under the `**`strata.X`**` heading above the table."""
    lines = MAP.read_text().splitlines()
    assert SECTION in lines, f"{MAP.name} has no {SECTION!r} section"
    out: dict[str, int] = {}
    heading = None
    for number, line in enumerate(lines[lines.index(SECTION) + 1 :], lines.index(SECTION) + 2):
        if line.startswith("## "):
            break
        if m := HEADING.match(line):
            heading = m.group(1)
        elif line.startswith("|") and heading is not None:
            first = line.split("|")[1]
            if set(first.strip()) <= {"-", " ", ":"} or first.strip() == "module":
                continue  # the table's separator or header
            for name in NAMED.findall(first):
                out[f"{heading}.{name}"] = number
    return out


def exists(dotted: str) -> bool:
    """Whether `dotted` is a module or a package of the product."""
    package, _, name = dotted.rpartition(".")
    folder = packages().get(package)
    return folder is not None and ((folder / f"{name}.py").is_file() or dotted in packages())


def test_every_module_has_a_row():
    rows = mapped()
    missing = [m for m in product_modules() if m not in rows]
    assert not missing, (
        f"{len(missing)} product modules have no row in {MAP.relative_to(ROOT)} ({SECTION[3:]!r}): "
        + ", ".join(missing)
        + " — add each under its package's heading (first cell: the module's name in backticks)"
    )


def test_every_row_names_a_module():
    stale = [f"{name} (line {line})" for name, line in mapped().items() if not exists(name)]
    assert not stale, (
        f"{MAP.relative_to(ROOT)} has rows for modules that do not exist: " + ", ".join(stale)
    )


def test_package_docstrings_name_their_modules():
    problems = []
    for package, folder in packages().items():
        docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        unnamed = [
            name for name in children(folder) if not re.search(rf"\b{re.escape(name)}\b", docstring)
        ]
        if unnamed:
            problems.append(
                f"{package} ({folder.relative_to(ROOT)}/__init__.py): {', '.join(unnamed)}"
            )
    assert not problems, "package docstrings that do not name each of their modules:\n" + "\n".join(
        problems
    )


def test_the_walk_finds_the_product():
    """The checks above see every layer (a package they cannot walk would make them pass vacuously)."""
    found = packages()
    for package in (
        "strata",
        "strata.plan",
        "strata.parallel",
        "strata.offload",
        "strata.checkpoint",
    ):
        assert package in found
    for package in ("strata.trainer", "strata.launch", "strata.data"):
        assert package in found
    assert {"strata.parallel.zero", "strata.trainer.loop", "strata.plan.memory"} <= set(
        product_modules()
    )


MAX_FILE_LINES = 700
MAX_FUNCTION_LINES = 80


def test_modules_and_functions_stay_small():
    """No product module over MAX_FILE_LINES lines and no function over MAX_FUNCTION_LINES: a file
    that outgrows its one job is split before it becomes the place everything is changed."""
    problems = []
    for module in product_modules():
        package, _, name = module.rpartition(".")
        path = packages()[package] / f"{name}.py"
        text = path.read_text()
        if (lines := len(text.splitlines())) > MAX_FILE_LINES:
            problems.append(f"{module}: {lines} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    where = f"{module}.{node.name} (line {node.lineno})"
                    problems.append(f"{where}: {length} lines (at most {MAX_FUNCTION_LINES})")
    assert not problems, "split these:\n" + "\n".join(problems)
