"""Plug-ins: algorithms, models, datasets, partitioners and server optimisers defined outside fedhet.

A plug-in is Python code that registers components with fedhet's own decorators (``@ALGORITHMS.register``,
``@MODELS.register``, ``@DATASETS.register``, ``@PARTITIONERS.register``, ``@SERVER_OPTIMIZERS.register``); importing
it is all that loading it does. There are two kinds, as elsewhere in the Python ecosystem (pytest, flake8):

* an **installed package** declares an entry point in the group ``fedhet.plugins``
  (``[project.entry-points."fedhet.plugins"] my_method = "my_package.my_method"``); every fedhet process loads
  every such entry point before it looks a component up, so nothing needs naming on the command line;
* a **loose file or module** is named in the config, ``run.plugins = ["my_method.py", "my_package.module"]``
  (``--plugin`` on the command line, ``plugins=`` in the Python API). A ``.py`` path is made absolute when the
  config is built, so the run's saved ``config.json`` names it and every process that builds the run from that
  config (worker processes, compare's cells, Flower nodes, ``fedhet resume``) loads the same file.

``load(specs)`` is idempotent: each file or module is imported once per process.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path

from fedhet.errors import ConfigError

GROUP = "fedhet.plugins"

_loaded: dict[str, str] = {}  # spec as given (file paths absolute) -> module name
_entry_points_loaded = False
_sources: dict[str, bytes] = {}  # module name -> the bytes of the plug-in file it was loaded from


def is_file(spec: str) -> bool:
    """A spec that names a file (``my_method.py``, ``dir/x.py``) rather than an importable module."""
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def normalise(spec: str, base: Path | None = None) -> str:
    """A file spec as an absolute path (relative ones are taken from ``base``, default the working directory);
    a module name unchanged. Refuses what is neither."""
    text = spec.strip()
    if not text:
        raise ValueError("a plug-in is a .py file or a module name, not an empty string")
    if is_file(text):
        path = Path(text).expanduser()
        if path.is_absolute():
            return str(path)
        path = (base or Path.cwd()) / path
        if os.path.islink(path) and not os.path.exists(path):  # a dangling link: named as given, not as its target
            return str(path.parent.resolve() / path.name)
        return str(path.resolve())
    if not all(part.isidentifier() for part in text.split(".")):
        raise ValueError(f"{text!r} is neither a .py file nor a module name (e.g. my_package.my_method)")
    return text


def load(specs: Iterable[str] = ()) -> None:
    """Import the installed ``fedhet.plugins`` entry points (once per process), then every spec not yet loaded."""
    load_entry_points()
    for spec in specs:
        if spec not in _loaded:
            _loaded[spec] = _load_file(spec) if is_file(spec) else _load_module(spec)


def loaded() -> dict[str, str]:
    """Plug-ins loaded in this process: spec -> module name (entry points as ``entry-point:NAME``)."""
    return dict(_loaded)


def load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=GROUP):
        key = f"entry-point:{ep.name}"
        if key in _loaded:
            continue
        try:
            ep.load()
        except Exception as err:  # a broken plug-in is named, not shown as a traceback from deep inside fedhet
            where = f"plug-in entry point {ep.name!r} ({ep.value}, group {GROUP})"
            raise ConfigError(f"{where} failed to load: {_why(err)}") from err
        _loaded[key] = ep.value


def _load_file(path: str) -> str:
    from fedhet.paths import check_input_file, name_problem

    file = Path(path)
    if not name_problem(file) and not os.path.lexists(file):
        raise ConfigError(
            f"plug-in file {path!r} (run.plugins) does not exist; pass its current path with --plugin, or set "
            "run.plugins"
        )
    # a regular readable file: a FIFO would hang the import, a folder or dangling link fail deep inside importlib
    check_input_file(file, "plug-in file", noun="Python file", setting="run.plugins")
    name = file.stem
    if not name.isidentifier():
        raise ConfigError(f"plug-in file {path!r}: its name must be a Python identifier (e.g. my_method.py)")
    existing = sys.modules.get(name)
    if existing is not None:
        if _same_source(name, getattr(existing, "__file__", None), file):
            # imported already (by the user's code, or a copy of this file: a moved plug-in, an app folder's copy)
            return name
        raise ConfigError(
            f"plug-in file {path!r}: a different module named {name!r} is already imported; rename the file"
        )
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"plug-in file {path!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    # in sys.modules under its file name, so pickle and dataclasses find the classes it defines
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ConfigError(f"plug-in file {path!r} failed to load: {_why(err)}") from err
    _sources[name] = file.read_bytes()
    return name


def _same_source(name: str, loaded: str | None, file: Path) -> bool:
    if loaded is not None and Path(loaded).resolve() == file.resolve():
        return True
    return _sources.get(name) == file.read_bytes()


def _load_module(name: str) -> str:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and name.startswith(err.name):
            raise ConfigError(
                f"plug-in module {name!r} (run.plugins) is not importable here; install its package, or pass a .py file"
            ) from None
        raise ConfigError(f"plug-in module {name!r} failed to load: {_why(err)}") from err
    except Exception as err:
        raise ConfigError(f"plug-in module {name!r} failed to load: {_why(err)}") from err
    return name


def _why(err: Exception) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())
