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
    "algorithms": {"flower", "results", "cli", "api", "comparison", "cells"},
    "engine": {"flower", "cli", "api", "comparison", "cells"},
    "results": {"data", "models", "algorithms", "engine", "flower", "cli", "api", "comparison", "cells"},
}
# The engine modules an algorithm may build on: the flat parameter view, the local loop and its optimiser, the
# evaluation and confusion helpers. The round loop, workers, checkpoints and run folders stay above the algorithms.
ENGINE_TOOLKIT = {"flat", "local", "evaluate", "confusion"}


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
                elif package == "algorithms" and parts[1] == "engine" and parts[2] not in ENGINE_TOOLKIT:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module} (not in the engine's toolkit)")
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from fedhet.engine.simulation import run\n")
    assert imported_modules(module) == ["fedhet.engine.simulation"]
