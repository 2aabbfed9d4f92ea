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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from fedhet.errors import ConfigError, Interrupted

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
        with _loading(f"plug-in entry point {ep.name!r} ({ep.value}, group {GROUP})"):
            ep.load()
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
    with _loading(f"plug-in file {path!r}"):
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]  # a later attempt imports it afresh
            raise
    _sources[name] = file.read_bytes()
    return name


def _same_source(name: str, loaded: str | None, file: Path) -> bool:
    if loaded is not None and Path(loaded).resolve() == file.resolve():
        return True
    return _sources.get(name) == file.read_bytes()


def _load_module(name: str) -> str:
    missing = False
    with _loading(f"plug-in module {name!r}"):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            missing = bool(err.name and name.startswith(err.name))  # the module itself, not one it imports
            if not missing:
                raise
    if missing:
        raise ConfigError(
            f"plug-in module {name!r} (run.plugins) is not importable here; install its package, or pass a .py file"
        )
    return name


@contextmanager
def _loading(what: str) -> Iterator[None]:
    """Importing the plug-in ``what``: whatever it raises is one line naming it, not a traceback from deep inside
    fedhet; a ``sys.exit()`` in it would otherwise end fedhet silently with its status, and a KeyboardInterrupt with
    no word of where it stopped."""
    try:
        yield
    except Exception as err:
        raise ConfigError(f"{what} failed to load: {_why(err)}") from err
    except SystemExit as err:
        raise ConfigError(f"{what} failed to load: it called sys.exit({err.code!r})") from None
    except KeyboardInterrupt:
        raise Interrupted(f"{what} was interrupted while it loaded; nothing ran") from None


def _why(err: Exception) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())


# ---------------------------------------------------------------------------------------------------------------
# Provenance of one's own code: what a run's plug-ins and fedhet itself were when it ran. provenance.json records
# ``{"fedhet": version_info(), "plugins": fingerprints(cfg.run.plugins)}``; a resume (``fedhet resume``, ``fedhet
# run --resume``) and a comparison's finished or resumable cell compare the saved fingerprints with the current ones
# (``changed``) and refuse, in one line naming the file, unless the user accepts the change
# (``--accept-changed-plugins``, ``accept_changed_plugins=True``): a plug-in edited after a run started would
# otherwise be skipped as finished or continued under code that did not compute the rounds before.

ACCEPT_FLAG = "--accept-changed-plugins"


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _tree_hash(root: Path) -> str:
    """SHA-256 over every .py file under ``root`` (its path relative to ``root``, then its bytes), sorted by path;
    ``__pycache__`` and hidden folders left out."""
    import hashlib

    digest = hashlib.sha256()
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts)
    )
    for path in files:
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        digest.update(len(rel).to_bytes(8, "big") + rel + len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


def fingerprint(spec: str) -> dict[str, str]:
    """What the plug-in ``spec`` is now: ``{"sha256": ..., "path": ...}`` (a file: the hash of its bytes; a module:
    of its source file, or of every .py file of its package), or ``{"error": why}`` when it cannot be read."""
    try:
        if is_file(spec):
            path = Path(spec)
            return {"kind": "file", "path": str(path), "sha256": _sha256(path.read_bytes())}
        found = importlib.util.find_spec(spec)
        origin = found.origin if found is not None else None
        if found is None or origin is None or not os.path.isfile(origin):
            return {"kind": "module", "error": "no source file found"}
        locations = list(found.submodule_search_locations or [])
        if locations:  # a package: every .py file of it
            root = Path(locations[0])
            return {"kind": "package", "path": str(root), "sha256": _tree_hash(root)}
        return {"kind": "module", "path": origin, "sha256": _sha256(Path(origin).read_bytes())}
    except (OSError, ImportError, ValueError) as err:
        return {"kind": "file" if is_file(spec) else "module", "error": _why(err)}


def fingerprints(specs: Iterable[str]) -> dict[str, dict[str, str]]:
    """spec -> ``fingerprint(spec)`` for every plug-in of a run (``run.plugins``) and every installed ``fedhet.plugins``
    entry point (``entry-point:NAME``, the module or package its value names)."""
    out = {spec: fingerprint(spec) for spec in specs}
    for ep in entry_points(group=GROUP):
        out[f"entry-point:{ep.name}"] = fingerprint(ep.value.split(":", 1)[0].strip())
    return out


def changed(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
    """The plug-ins whose code differs between ``saved`` (provenance.json's ``plugins``) and ``current``, each as
    "file X (sha256 abc... -> def...)". A plug-in is compared by its file (or module) name, so a run folder moved
    with its plug-in (a new absolute path, the same bytes) is unchanged; one recorded without a hash (a run from
    before fedhet recorded them: ``saved`` None) is not compared."""
    if not saved:
        return []
    by_name = {_plugin_key(spec): info for spec, info in current.items()}
    out = []
    for spec, old in saved.items():
        if not isinstance(old, dict) or "sha256" not in old:
            continue
        new = current.get(spec) or by_name.get(_plugin_key(spec))
        what = f"{old.get('kind', 'plug-in')} {old.get('path') or spec}"
        if new is None:
            continue  # no longer a plug-in of this run (replaced with --plugin): config_changes words a component
        if "sha256" not in new:
            out.append(f"{what} ({new.get('error', 'unreadable')})")
        elif new["sha256"] != old["sha256"]:
            where = "" if new.get("path") == old.get("path") else f", now {new.get('path')}"
            out.append(f"{what} (sha256 {old['sha256'][:12]} -> {new['sha256'][:12]}{where})")
    return out


def _plugin_key(spec: str) -> str:
    return Path(spec).name if is_file(spec) else spec


def plugin_module(spec: str) -> str | None:
    """The module a plug-in spec (``fingerprints``' keys) is imported as: a file's name without .py, a module's
    own name, an entry point's target; None for an entry point no longer installed."""
    if spec.startswith("entry-point:"):
        name = spec.split(":", 1)[1]
        ep = next((e for e in entry_points(group=GROUP) if e.name == name), None)
        return ep.value.split(":", 1)[0].strip() if ep is not None else None
    return _loaded.get(spec) or (Path(spec).stem if is_file(spec) else spec)


def used_by(current: dict[str, Any], modules: Iterable[str]) -> dict[str, Any]:
    """The fingerprints in ``current`` of the plug-ins whose code defines one of ``modules`` (the components a run
    names): same top-level module or package, since a package's plug-in module may register classes defined in
    its other modules. A plug-in whose module is unknown counts as used."""
    tops = {m.split(".", 1)[0] for m in modules}
    out = {}
    for spec, info in current.items():
        module = plugin_module(spec)
        if module is None or module.split(".", 1)[0] in tops:
            out[spec] = info
    return out


# set by --accept-changed-plugins (accept_changes()); an environment variable, so compare's worker processes and
# Flower's see it too
ACCEPT_ENV = "FEDHET_ACCEPT_CHANGED_PLUGINS"


def accept_changes(accept: bool = True) -> None:
    """``--accept-changed-plugins``: this process and those it starts continue runs whose plug-ins changed."""
    if accept:
        os.environ[ACCEPT_ENV] = "1"
    else:
        os.environ.pop(ACCEPT_ENV, None)


def accepting_changes() -> bool:
    return os.environ.get(ACCEPT_ENV, "") not in ("", "0")


def check_unchanged(
    saved: dict[str, Any] | None, current: dict[str, Any], where: str | Path, accept: bool | None = None
) -> list[str]:
    """Refuse (ConfigError, one line) to go on with run folder ``where`` when a plug-in changed since its run
    recorded ``saved``, unless ``accept`` (None: ``--accept-changed-plugins`` was given, ``accepting_changes()``);
    returns the changes (for a warning when accepted)."""
    if accept is None:
        accept = accepting_changes()
    diffs = changed(saved, current)
    if diffs and not accept:
        raise ConfigError(
            f"cannot continue {where}: its plug-in code changed since the run recorded it: {'; '.join(diffs)}; "
            f"restore it, or pass {ACCEPT_FLAG} (accept_changed_plugins=True) to continue under the new code, or "
            "start a new run (--overwrite or another run.name)"
        )
    return diffs


# provenance.json's record of plug-in code accepted for a finished run that did not train under it (compare skips
# the cell): {"plugins": ..., "after_resumes": how many resumes the run had then}
ACCEPTED_KEY = "plugins_accepted"


def saved_fingerprints(run_dir: str | Path) -> dict[str, Any] | None:
    """The plug-in fingerprints a run folder's provenance.json recorded last (the newest resume that recorded them,
    or a change accepted since without training, ``ACCEPTED_KEY``, else the run's start: a change accepted once is
    not refused again), or None (none recorded, unreadable)."""
    import json

    try:
        info = json.loads((Path(run_dir) / "provenance.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    resumes = info.get("resumes")
    records = [r for r in resumes if isinstance(r, dict)] if isinstance(resumes, list) else []
    accepted = info.get(ACCEPTED_KEY)
    since = len(resumes) if isinstance(resumes, list) else 0
    if (
        isinstance(accepted, dict)
        and isinstance(accepted.get("plugins"), dict)
        and accepted.get("after_resumes") == since
    ):
        return accepted["plugins"]  # accepted after the last resume
    for record in [*reversed(records), info]:
        if isinstance(record.get("plugins"), dict):
            return record["plugins"]
    return None


def fedhet_version() -> dict[str, Any]:
    """``{"version": "0.1.0"}``, plus ``"commit"`` (and ``"dirty": True`` when tracked files differ from it) when
    fedhet runs from a git checkout; provenance.json's ``fedhet_code`` and ``fedhet --version``."""
    import subprocess

    from fedhet import __version__

    info: dict[str, Any] = {"version": __version__}
    root = Path(__file__).resolve().parent.parent.parent  # src/fedhet -> the checkout's root
    if not (root / ".git").exists():
        return info  # an installed copy: its version says what it is
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "src"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return info
    if commit:
        info["commit"] = commit
        info["dirty"] = bool(status.strip())
    return info


def provenance(specs: Iterable[str]) -> dict[str, Any]:
    """What provenance.json records of the code that ran: ``{"fedhet_code": fedhet_version(), "plugins":
    fingerprints(specs)}``."""
    return {"fedhet_code": fedhet_version(), "plugins": fingerprints(specs)}
