"""Every third-party package a module of src/fedhet imports is declared in pyproject.toml, where the import needs it.

A package that another dependency happens to bring is not enough (typer stopped depending on click, and fedhet
imports click): each import must be named by the dependency list that guards it.

* An import that runs when a module is imported (its top level, outside ``if TYPE_CHECKING:`` and outside a
  ``try`` that catches ImportError) needs a core dependency, unless the module belongs to an extra's package
  (``fedhet.flower``: the ``flower`` extra) and no core module imports it at its top level.
* An import inside a function, or in a ``try`` that catches ImportError, is guarded: the extras that its module
  tells the user to install (``pip install 'fedhet[hf]'``), with the module's package extra, must declare it.

Import names are mapped to distributions with importlib.metadata (``PIL`` is pillow, ``sklearn`` scikit-learn)."""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from fedhet.config import tomllib  # tomli before Python 3.11

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
# fedhet's packages whose modules may import an extra's packages at their top level (the CLI lazy-loads them)
PACKAGE_EXTRAS = {"fedhet.flower": "flower"}
NAMED_EXTRA = re.compile(r"fedhet\[([a-z0-9_-]+)\]")


@dataclass
class Module:
    name: str
    path: Path
    top: list[tuple[str, int]] = field(default_factory=list)  # (imported name, line) run on import
    guarded: list[tuple[str, int]] = field(default_factory=list)  # inside a function or an ImportError try
    fedhet_top: set[str] = field(default_factory=set)  # fedhet modules imported at the top level
    named_extras: set[str] = field(default_factory=set)


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """The core dependencies and each extra's, as canonical distribution names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        return {canonicalize_name(Requirement(r).name) for r in reqs}

    extras = {extra: names(reqs) for extra, reqs in project["optional-dependencies"].items()}
    return names(project["dependencies"]), extras


def catches_import_error(node: ast.Try) -> bool:
    caught = [h.type for h in node.handlers]
    names = {n.id for t in caught if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def imported_names(node: ast.AST, package: str) -> list[str]:
    """The modules an import statement (or an ``importlib.util.find_spec("x")``) names, relative ones resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        parts = package.split(".")
        base = parts[: len(parts) - node.level + 1] if node.level else []
        module = ".".join([*base, *([node.module] if node.module else [])])
        return [module, *(f"{module}.{alias.name}" for alias in node.names)]
    if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("find_spec"):
        return [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return []


def scan(path: Path, src: Path = SRC) -> Module:
    name = ".".join(path.relative_to(src).with_suffix("").parts).removesuffix(".__init__")
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    source = path.read_text()
    module = Module(name, path.relative_to(src.parent), named_extras=set(NAMED_EXTRA.findall(source)))

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return  # only type checkers read these
        names = imported_names(node, package)
        if not guarded and not isinstance(node, ast.Call):
            module.fedhet_top.update(n for n in names if n.split(".")[0] == "fedhet")
        # `from a.b import c` imports the distribution of a once (c may be a submodule of a.b: same distribution)
        tops = {n.split(".")[0] for n in (names[:1] if isinstance(node, ast.ImportFrom) else names)}
        for top in sorted(tops - {"fedhet"} - set(sys.stdlib_module_names)):
            (module.guarded if guarded else module.top).append((top, node.lineno))
        inner = guarded or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        inner = inner or (isinstance(node, ast.Try) and catches_import_error(node))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source, str(path)), guarded=False)
    return module


def scan_all(src: Path = SRC) -> dict[str, Module]:
    return {m.name: m for m in (scan(p, src) for p in sorted((src / "fedhet").rglob("*.py")))}


def package_extra(name: str) -> str | None:
    return next((extra for pkg, extra in PACKAGE_EXTRAS.items() if name.startswith(pkg + ".")), None)


def loaded_with_core(modules: dict[str, Module]) -> set[str]:
    """The modules that importing a core module imports (top-level imports, followed, with their parent packages)."""
    todo = [name for name in modules if package_extra(name) is None]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        for target in modules[name].fedhet_top:
            parts = target.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return seen


@cache
def installed() -> dict[str, list[str]]:
    return packages_distributions()  # top-level import name -> the distributions that provide it here


def distributions(import_name: str) -> set[str]:
    """The distributions that provide a top-level import name here (its own name if none installed here does)."""
    found = installed().get(import_name) or [import_name]
    return {canonicalize_name(d) for d in found}


LAZY = "lazily: in neither the core dependencies nor the extras its module names"


def undeclared(modules: dict[str, Module]) -> list[str]:
    core, extras = declared()
    core_loaded = loaded_with_core(modules)
    problems = []
    for module in modules.values():
        home = package_extra(module.name)
        guarding = module.named_extras | ({home} if home else set())
        if guarding - set(extras):
            problems.append(f"{module.name} names extras that pyproject.toml lacks: {sorted(guarding - set(extras))}")
        if home is None or module.name in core_loaded:
            top = (core, "when it is imported: not a core dependency" + (" (a core module loads it)" if home else ""))
        else:
            top = (core | extras[home], f"when it is imported: in neither the core dependencies nor {home}")
        lazy = (
            core.union(*(extras[e] for e in guarding if e in extras)),
            f"{LAZY} ({', '.join(sorted(guarding)) or 'none'})",
        )
        for imports, (allowed, how) in ((module.top, top), (module.guarded, lazy)):
            problems += [
                f"{module.path}:{line} imports {name} ({', '.join(sorted(distributions(name)))}) {how}"
                for name, line in imports
                if not distributions(name) & allowed
            ]
    return problems


def test_every_imported_package_is_declared_where_it_is_needed():
    modules = scan_all()
    assert len(modules) > 30
    problems = undeclared(modules)
    assert problems == [], "undeclared dependencies:\n" + "\n".join(problems)


def test_the_trackers_packages_are_in_the_trackers_extra():
    """trackers.py checks its packages by name (importlib.util.find_spec(module)), which the scan cannot follow."""
    from fedhet.results.trackers import PACKAGES

    _, extras = declared()
    for module, package in PACKAGES.values():
        assert canonicalize_name(package) in extras["trackers"]
        if module in installed():  # installed here (make setup installs the extra)
            assert canonicalize_name(package) in distributions(module)


def write_package(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = tmp_path / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return scan_all(tmp_path / "src")


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"fedhet/cli.py": "import requests\n"}, ["imports requests (requests) when it is imported: not a core"]),
        (
            {"fedhet/a.py": "def f():\n    import pandas\n"},
            [f"imports pandas (pandas) {LAZY} (none)"],
        ),
        (
            {"fedhet/a.py": "def f():\n    import wandb  # pip install 'fedhet[pandas]'\n"},
            [f"imports wandb (wandb) {LAZY} (pandas)"],
        ),
        ({"fedhet/a.py": "try:\n    import flwr\nexcept ImportError:\n    pass\n"}, ["imports flwr"]),
        ({"fedhet/a.py": "import importlib.util\nimportlib.util.find_spec('datasets')\n"}, ["imports datasets"]),
        ({"fedhet/a.py": "# fedhet[nope]\n"}, ["names extras that pyproject.toml lacks: ['nope']"]),
        ({"fedhet/flower/__init__.py": "", "fedhet/flower/x.py": "import flwr\n"}, []),
        (
            {"fedhet/flower/__init__.py": "", "fedhet/flower/x.py": "import wandb\n"},
            ["imports wandb (wandb) when it is imported: in neither the core dependencies nor flower"],
        ),
        (
            {"fedhet/flower/__init__.py": "import fedhet.flower.x\n", "fedhet/flower/x.py": "import flwr\n"},
            ["(a core module loads it)"],
        ),
        (
            {"fedhet/flower/__init__.py": "from . import x\n", "fedhet/flower/x.py": "import flwr\n"},
            ["(a core module loads it)"],
        ),
        ({"fedhet/a.py": "def f():\n    import pandas  # pip install 'fedhet[pandas]'\n"}, []),
        ({"fedhet/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pandas\n"}, []),
        ({"fedhet/a.py": "import numpy, torch, typer, rich, PIL, sklearn, tomli_w\nfrom pydantic_core import x\n"}, []),
    ],
)
def test_the_scan_finds_undeclared_imports(tmp_path, files, expected):
    """The rule itself, on small packages: each undeclared import is caught, each declared or guarded one passes."""
    problems = undeclared(write_package(tmp_path, files))
    assert len(problems) == len(expected), problems
    for problem, words in zip(problems, expected, strict=True):
        assert words in problem
