"""The import rules of tiergen/, read from its source (see docs/ARCHITECTURE.md).

Every import counts, function-local ones too: an import moved into a function to dodge a
circle shows up here as the circle it dodges.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tiergen"

GROUND = {"tiergen.errors", "tiergen._platform", "tiergen.config", "tiergen.tokenizer",
          "tiergen.devices", "tiergen.paths", "tiergen.calibration"}
LOWER = ("models", "cache", "offload", "weights", "kernels")  # what a model's run is made of
UPPER = ("engine", "planner", "server", "cli", "bench", "batch")  # what drives a run
TRANSPORT = ("parallel",)  # links between ranks: below the engine, above the models


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


def _area(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


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


def _upward(sources: tuple[str, ...], targets: tuple[str, ...]) -> list[str]:
    return [f"{a} imports {b}" for a, deps in sorted(GRAPH.items()) if _area(a) in sources
            for b in sorted(deps) if _area(b) in targets]


def test_model_parts_import_nothing_that_drives_them():
    assert _upward(LOWER, UPPER + TRANSPORT) == []


def test_transport_imports_no_schedule():
    assert _upward(TRANSPORT, UPPER) == []


def test_ground_floor_imports_only_the_ground_floor():
    wrong = [f"{a} imports {b}" for a in sorted(GROUND & GRAPH.keys())
             for b in sorted(GRAPH[a]) if b not in GROUND]
    assert wrong == []

