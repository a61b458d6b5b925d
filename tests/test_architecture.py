"""The import rules of tiergen/, read from its source, checked against the table of floors
in docs/ARCHITECTURE.md, one rule per row, read from the doc itself so that the two cannot
differ.

Every import counts, function-local ones too: an import moved into a function to dodge a
circle shows up here as the circle it dodges.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "tiergen"
DOC = ROOT.parent / "docs" / "ARCHITECTURE.md"


@dataclass(frozen=True)
class Floor:
    """A row of the doc's table of floors: the files and packages on it, what the table
    says it may import (its last cell), and the rows that means, besides its own."""

    names: tuple[str, ...]  # as the table writes them: "errors.py", "weights/"
    may_import: str
    allowed: frozenset[int]
    forbidden: tuple[tuple[str, str], ...] = ()  # (importer, imported) the cell excepts


def _floors() -> list[Floor]:
    """The table of docs/ARCHITECTURE.md's "The floors", read so that the rules checked here
    are the rules the doc states: each last cell is one of the forms below, or the test
    fails rather than guess."""
    text = DOC.read_text(encoding="utf-8").split("## The floors", 1)[1]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.split("\n\n", 2)[1].splitlines() if line.startswith("|")][2:]
    names = [tuple(re.findall(r"`([^`]+)`", row[0])) for row in rows]

    def row_of(name: str) -> int:
        return next(i for i, ns in enumerate(names) if name in ns)

    floors = []
    for i, (ns, row) in enumerate(zip(names, rows)):
        cell, forbidden = row[-1], ()
        if cell == "each other only":
            allowed = set()
        elif m := re.fullmatch(r"`([^`]+)` and below", cell):
            allowed = set(range(row_of(m.group(1)) + 1))
        elif cell == "everything above it in this table":
            allowed = set(range(i))
        elif m := re.fullmatch(r"anything(?: \((.+) not (.+)\))?", cell):
            allowed = set(range(len(rows)))
            if m.group(1):
                forbidden = tuple((a, b) for a in re.findall(r"`([^`]+)`", m.group(1))
                                  for b in re.findall(r"`([^`]+)`", m.group(2)))
        else:
            allowed = set()
            for part in cell.split(", "):
                if part == "the ground":
                    allowed.add(0)
                elif m := re.fullmatch(r"`([^`]+)`", part):
                    allowed.add(row_of(m.group(1)))
                else:
                    raise ValueError(f"ARCHITECTURE.md: a rule this test cannot read: {cell!r}")
        floors.append(Floor(ns, cell, frozenset(allowed - {i}), forbidden))
    return floors


FLOORS = _floors()


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str) -> set[str]:
    """The tiergen modules ``name`` imports, wherever in the file the import stands."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:  # ``from tiergen import kernels`` imports a module
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _module_of(name: str) -> str:
    """The module a name of the table stands for: ``weights/`` the package and all it holds,
    ``errors.py`` the file, ``__init__.py`` the package tiergen itself."""
    if name == "__init__.py":
        return "tiergen"
    return "tiergen." + name.removesuffix("/").removesuffix(".py").replace("/", ".")


def _on(floor: Floor, module: str) -> bool:
    return any(module == _module_of(n) or (n.endswith("/") and module.startswith(
        _module_of(n) + ".")) for n in floor.names)


def _floor(module: str) -> int:
    found = [i for i, f in enumerate(FLOORS) if _on(f, module)]
    assert len(found) == 1, f"{module} stands on {len(found)} floors of ARCHITECTURE.md's table"
    return found[0]


def test_every_file_stands_on_one_floor_and_every_floor_has_files():
    for module in MODULES:
        _floor(module)
    for floor in FLOORS:
        for name in floor.names:
            assert any(_on(Floor((name,), "", frozenset()), m) for m in MODULES), name


@pytest.mark.parametrize("index", range(len(FLOORS)), ids=[f.names[0] for f in FLOORS])
def test_a_floor_imports_only_what_the_table_allows(index: int):
    """One rule per row of the table: a file imports its own floor's files and those the
    row's last cell names, nothing else."""
    floor = FLOORS[index]
    wrong = [f"{a} imports {b} ({floor.names[0]} may import {floor.may_import})"
             for a in sorted(GRAPH) if _floor(a) == index for b in sorted(GRAPH[a])
             if _floor(b) not in floor.allowed | {index}
             or any(a == _module_of(x) and b == _module_of(y) for x, y in floor.forbidden)]
    assert wrong == []


def test_the_table_reads_as_the_doc_means_it():
    """The rules read from the table, spelled out for a few rows: a misreading of the
    table would otherwise loosen every rule at once."""
    def rule(name: str) -> set[str]:
        floor = next(f for f in FLOORS if name in f.names)
        return {FLOORS[i].names[0] for i in floor.allowed}

    assert rule("errors.py") == set()
    assert rule("weights/") == {"errors.py"}
    assert rule("kernels/") == {"errors.py", "weights/"}
    assert rule("cache/") == {"errors.py", "kernels/"}
    assert rule("offload/") == {"errors.py", "weights/", "kernels/", "cache/", "models/"}
    assert rule("parallel/") == {"errors.py", "weights/", "models/"}
    assert rule("perplexity.py") == {"errors.py"}
    assert {"engine/", "parallel/", "offload/"} <= rule("server/") and "planner/" not in rule(
        "server/")
    assert next(f for f in FLOORS if "cli.py" in f.names).forbidden == (
        ("bench.py", "cli.py"), ("batch.py", "cli.py"))


def test_no_circle_between_files():
    state: dict[str, int] = {}  # 1: on the path, 2: done
    circles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                circles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert not circles, "import circles:\n" + "\n".join(circles)
