"""The package's layers (docs/architecture.md): data flows down, imports never reach up, and no module imports itself
through others.

Every ``import fedhet.X`` / ``from fedhet.X import`` in every module of the package, at any depth (a lazy import in
a function counts too), is checked; importing ``fedhet.a.b`` from outside ``fedhet.a`` also runs ``fedhet/a/__init__``,
so it counts as importing ``fedhet.a`` as well."""

from __future__ import annotations

import ast
from pathlib import Path

import fedhet

ROOT = Path(fedhet.__file__).parent
# Bottom to top: a module may import modules of its own layer and of the layers below, never of one above. The key is
# the name under fedhet ("engine" for fedhet.engine.simulation, "config" for fedhet.config, "__init__" for fedhet), or
# the module's own name where it sits in another layer than its package ("flower.cli": a CLI command).
LAYERS = (
    # what everything reads: errors, strict parameter models, path checks, machine facts (free memory), the Hugging
    # Face Hub's reach, plug-in loading, name -> factory tables
    {"errors", "hub", "params", "paths", "machine", "plugins", "registry"},
    # the components a config names (datasets and partitioners, models) and the run folder's files (metrics, reports,
    # plots, trackers); none of the three imports another
    {"data", "models", "results"},
    # the validated config: checks a model against its dataset (models/fit.py) and a tracker's package
    {"config"},
    {"toolkit"},  # flat vectors, the local loop's optimiser and batches, evaluation and confusion helpers
    {"algorithms"},  # the contract, the shared local loop, one file per algorithm
    {"components"},  # the config sections that pick a registered component, with their registries
    # the round loop and its parts; the run folder's name (its hash resolves every component, an old folder is
    # compared as a resume would); search spaces (tuning: checked against the config as a run resolves it)
    {"engine", "naming", "tuning"},
    {"flower"},  # the same round loop over Flower messages
    # what a user calls: the CLI (fedhet flower ... too), the Python API, many runs at once, the settings reference,
    # the package's lazy names
    {"cli", "cli_shared", "cli_cache", "flower.cli", "api", "comparison", "cells", "reference", "__init__"}
    # the tuner: many runs (trials) like compare's cells, and compare --tune
    | {"tuning.study", "tuning.trials", "tuning.tuner", "tuning.compare"},
)
# packages in one layer that import nothing from each other
APART = {"data", "models", "results"}


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, not ``.__init__``)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = ".".join(("fedhet", *path.relative_to(ROOT).with_suffix("").parts))
        found[name.removesuffix(".__init__")] = path
    return found


def imported_modules(path: Path, typing_too: bool = True) -> list[str]:
    """The fedhet names ``path`` imports, lazy imports in functions included (``from fedhet.a import b`` gives
    ``fedhet.a`` and ``fedhet.a.b``: b may be a module); without ``typing_too``, imports for annotations only (under
    ``if TYPE_CHECKING:``) are left out."""
    tree = ast.parse(path.read_text())
    typing_only = set()
    if not typing_too:
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for n in ast.walk(node)
        }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [name for name in found if name == "fedhet" or name.startswith("fedhet.")]


def module_edges(name: str, imported: list[str], known: dict[str, Path]) -> set[str]:
    """The fedhet modules importing ``imported`` runs from module ``name``: each imported module and the packages
    above it that ``name`` is not inside (their ``__init__`` runs first); the lazy top package ``fedhet`` aside."""
    out = set()
    for item in imported:
        parts = item.split(".")
        for depth in range(2, len(parts) + 1):
            target = ".".join(parts[:depth])
            if target in known and target != name and not name.startswith(target + "."):
                out.add(target)
    return out


def import_graph(typing_too: bool) -> dict[str, set[str]]:
    known = modules()
    return {name: module_edges(name, imported_modules(path, typing_too), known) for name, path in known.items()}


def layer_key(module: str) -> str:
    """``fedhet.engine.simulation`` -> "engine"; a module LAYERS names itself ("flower.cli") -> that name."""
    parts = module.split(".")
    own = ".".join(parts[1:3])
    if own in set().union(*LAYERS):
        return own
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> int:
    key = layer_key(module)
    return next(i for i, layer in enumerate(LAYERS) if key in layer)


def test_every_module_has_a_layer():
    keys = {layer_key(name) for name in modules()}
    listed = set().union(*LAYERS)
    assert sum(len(layer) for layer in LAYERS) == len(listed), "a name in two layers"
    assert keys <= listed, f"modules in no layer of LAYERS: {sorted(keys - listed)}"
    assert listed <= keys, f"LAYERS names what no longer exists: {sorted(listed - keys)}"


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for name, targets in import_graph(typing_too=True).items():
        for target in sorted(targets):
            upward = layer_of(target) > layer_of(name)
            sideways = layer_key(name) != layer_key(target) and {layer_key(name), layer_key(target)} <= APART
            if upward or sideways:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
    return seen


def circles(graph: dict[str, set[str]]) -> list[str]:
    """The modules that import themselves through others."""
    return [start for start in sorted(graph) if start in reach(graph, start)]


def test_no_import_circle_in_the_package():
    """No module reaches itself through its runtime imports (lazy ones included; annotations-only imports aside)."""
    found = circles(import_graph(typing_too=False))
    assert not found, f"modules that import themselves through others: {found}"


def test_the_check_sees_lazy_imports_and_leaves_annotations_out(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from fedhet.engine.client import Executor\n"
        "def f():\n    from fedhet.engine.simulation import run\n"
    )
    assert set(imported_modules(module, typing_too=False)) == {
        "fedhet.engine.simulation",
        "fedhet.engine.simulation.run",
    }
    assert "fedhet.engine.client" in imported_modules(module)


def test_importing_a_submodule_counts_its_package():
    known = {"fedhet.models": Path(), "fedhet.models.fit": Path(), "fedhet.config": Path()}
    assert module_edges("fedhet.config", ["fedhet.models.fit", "fedhet.models.fit.misfit"], known) == {
        "fedhet.models",
        "fedhet.models.fit",
    }
    assert module_edges("fedhet.models.fit", ["fedhet.models"], known) == set()  # its own package: already running


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]


def test_a_lazy_import_that_closes_a_circle_is_found(tmp_path):
    """A name re-exported from an old place through a module ``__getattr__`` (an import inside a function) is a
    runtime edge like any other: it closes a circle with the module that imports the old place's module."""
    (tmp_path / "low.py").write_text("def __getattr__(name):\n    from fedhet.high import moved\n\n    return moved\n")
    (tmp_path / "high.py").write_text("from fedhet.low import helper\n")
    known = {"fedhet.low": tmp_path / "low.py", "fedhet.high": tmp_path / "high.py"}
    graph = {name: module_edges(name, imported_modules(path, typing_too=False), known) for name, path in known.items()}
    assert graph == {"fedhet.low": {"fedhet.high"}, "fedhet.high": {"fedhet.low"}}
    assert circles(graph) == ["fedhet.high", "fedhet.low"]
