"""The package's layers (docs/architecture.md): data flows down, imports never reach up.

Every ``import fedhet.X`` / ``from fedhet.X import`` in a module, at any depth (a lazy import in a function counts
too), is checked against the layers that module may not use."""

from __future__ import annotations

import ast
from pathlib import Path

import fedhet

ROOT = Path(fedhet.__file__).parent
# package -> the fedhet packages its modules must not import
FORBIDDEN = {
    "data": {"models", "algorithms", "engine", "flower", "results", "cli", "api", "comparison", "cells"},
    "models": {"data", "algorithms", "engine", "flower", "results", "cli", "api", "comparison", "cells"},
    "toolkit": {"algorithms", "engine", "flower", "results", "cli", "api", "comparison", "cells"},
    "algorithms": {"engine", "flower", "results", "cli", "api", "comparison", "cells"},
    "engine": {"flower", "cli", "api", "comparison", "cells"},
    "results": {"data", "models", "algorithms", "engine", "flower", "cli", "api", "comparison", "cells"},
}
# What algorithms build on (the flat parameter view, the local loop's optimiser and batches, evaluation and confusion
# helpers) is the toolkit layer under them (fedhet/toolkit/); fedhet.engine.{flat,local,evaluate,confusion} remain as
# re-exports for plug-ins written before, and no fedhet module imports them.
ENGINE_SHIMS = {"flat", "local", "evaluate", "confusion"}


def imported_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return [name for name in found if name.startswith("fedhet.")]


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for module in imported_modules(path):
                parts = module.split(".")
                if parts[1] in forbidden:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from fedhet.engine.simulation import run\n")
    assert imported_modules(module) == ["fedhet.engine.simulation"]


def test_no_module_imports_the_engine_shims():
    shims = {f"fedhet.engine.{name}" for name in ENGINE_SHIMS}
    wrong = [
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted(ROOT.rglob("*.py"))
        if not (path.parent.name == "engine" and path.stem in ENGINE_SHIMS)
        for module in imported_modules(path)
        if module in shims
    ]
    assert not wrong, "\n".join(wrong)


def runtime_imports(path: Path) -> set[str]:
    """The fedhet modules ``path`` imports when it runs (lazy imports too; annotations-only imports under
    ``if TYPE_CHECKING:`` left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_no_import_circle_among_the_toolkit_algorithms_and_engine():
    """The loop and the contract, the executors and the round loop: no module reaches itself through its imports."""
    modules = {}
    for package in ("toolkit", "algorithms", "engine"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(("fedhet", package, *path.relative_to(ROOT / package).with_suffix("").parts))
            modules[name.removesuffix(".__init__")] = path
    graph = {name: runtime_imports(path) & set(modules) for name, path in modules.items()}
    circles = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name == start:
                circles.append(start)
                break
            if name not in seen:
                seen.add(name)
                todo.extend(graph[name])
    assert not circles, f"modules that import themselves through others: {sorted(circles)}"
