"""Write a runnable Flower app folder (for ``flwr run``) from a fedhet config.

The folder holds three small files and no fedhet code: everything runs from the installed fedhet package, so
fedhet (with its ``flower`` extra) must be installed on the SuperLink machine and on every SuperNode machine.
Plug-in files of the config (``run.plugins``) are copied into ``plugins/`` and named relative to fedhet.toml, so
they travel with the app; plug-in modules and installed entry points must be installed there like fedhet.

* ``pyproject.toml``: Flower app metadata, the ServerApp / ClientApp components and the run config (``RUN_CONFIG``)
* ``fedhet.toml``: the fedhet config of the run (edit it, or override keys with ``--run-config 'overrides="..."'``)
* ``fedhet_app.py``: two lines that build the components from fedhet.toml
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import tomli_w

from fedhet.config import Config
from fedhet.errors import ConfigError

MODULE = '''"""Flower components of this fedhet app, written by `fedhet flower app`; the run is in fedhet.toml."""

from pathlib import Path

from fedhet.flower.app import folder_client_app, folder_server_app

HERE = Path(__file__).resolve().parent
# One assignment per component: `flwr` finds them by reading this file, without importing it.
server_app = folder_server_app(HERE)
client_app = folder_client_app(HERE)
'''


def app_name(text: str) -> str:
    """A valid Flower app name (letters, digits and hyphens, starting with a letter, at most 32 characters)."""
    name = re.sub(r"[^A-Za-z0-9-]+", "-", text).strip("-").lower()
    if not name or not name[0].isalpha():
        name = f"fedhet-{name}".rstrip("-")
    return name[:32].rstrip("-")


def drop_none(d: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: leave unset (None) values out, so they take their defaults again when read back."""
    return {k: drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def pyproject(name: str, cfg: Config) -> dict[str, Any]:
    from fedhet.flower.app import RUN_CONFIG

    return {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {
            "name": name,
            "version": "1.0.0",
            "description": f"fedhet {cfg.algorithm.name} on {cfg.dataset.name} ({cfg.partition.name} split) on Flower",
            "license": "Apache-2.0",
            # None: fedhet[flower] is installed on every machine beforehand (docs/deploy.md). A SuperLink that
            # installs app dependencies (`uv sync`) would otherwise put a second numpy/torch stack next to it.
            "dependencies": [],
        },
        "tool": {
            "hatch": {"build": {"targets": {"wheel": {"packages": ["."]}}}},
            "flwr": {
                "app": {
                    "publisher": "fedhet",
                    "components": {"serverapp": "fedhet_app:server_app", "clientapp": "fedhet_app:client_app"},
                    "config": dict(RUN_CONFIG),
                }
            },
        },
    }


def write_app(cfg: Config, out_dir: str | Path, name: str | None = None, force: bool = False) -> Path:
    """Write the app folder for ``cfg`` into ``out_dir``; returns the folder."""
    from fedhet.engine.training import resolve_config
    from fedhet.flower.app import check_synchronous

    resolve_config(cfg)  # fail now on a wrong name or value, not on the SuperLink
    check_synchronous(cfg)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not force:
        raise ConfigError(f"{str(out)!r} is not empty; pass --force to overwrite its app files")
    out.mkdir(parents=True, exist_ok=True)
    name = app_name(name or out.resolve().name)
    (out / "pyproject.toml").write_text(tomli_w.dumps(pyproject(name, cfg)))
    raw = drop_none(cfg.to_dict())
    raw["run"]["plugins"] = bundle_plugins(cfg.run.plugins, out)
    (out / "fedhet.toml").write_text(tomli_w.dumps(raw))
    (out / "fedhet_app.py").write_text(MODULE)
    return out


def bundle_plugins(specs: list[str], out: Path) -> list[str]:
    """Copy the plug-in files into ``out/plugins``; returns the specs as fedhet.toml names them (files relative to
    it, modules unchanged)."""
    from fedhet.plugins import is_file

    names = [Path(spec).name for spec in specs if is_file(spec)]
    if len(set(names)) < len(names):
        raise ConfigError(f"plug-in files with the same name cannot share an app folder: {', '.join(names)}")
    bundled = []
    for spec in specs:
        if not is_file(spec):
            bundled.append(spec)
            continue
        target = out / "plugins" / Path(spec).name
        target.parent.mkdir(exist_ok=True)
        if Path(spec).resolve() != target.resolve():
            shutil.copyfile(spec, target)
        bundled.append(f"plugins/{target.name}")
    return bundled
