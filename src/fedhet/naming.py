"""The run folder's name, and the paths a config names.

A config without ``run.name`` runs in ``run.out_dir/<algorithm>-<dataset>-<partitioner>-s<seed>`` plus, when any
setting that changes the numbers is not its default, a short hash of those settings (``default_name``). Telling
settings from defaults needs every component's parameters resolved against its registry, and finding a folder named
before names had a hash needs the engine's comparison of configs, so this sits above the engine's config handling
(``engine/training.py``) and below the round loop; ``config.py`` under it names nothing it would have to import.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from fedhet import plugins
from fedhet.components import component_registries
from fedhet.config import NAME_HASH_CHARS, RESUMABLE_CHANGES, Config
from fedhet.engine.rundir import holds_run
from fedhet.engine.training import config_changes, resolve_config
from fedhet.errors import FedhetError
from fedhet.models.fit import DEFAULT_MODEL, default_model
from fedhet.paths import check_folder, check_output_file, mlflow_paths


def run_name(cfg: Config) -> str:
    """The run folder's name: ``run.name``, else ``default_name``."""
    return cfg.run.name or default_name(cfg)


def run_dir(cfg: Config) -> Path:
    """``run.out_dir/run_name(cfg)``: where the run's files go."""
    return Path(cfg.run.out_dir) / run_name(cfg)


def default_name(cfg: Config) -> str:
    """The run folder's name when ``run.name`` is unset: ``scaffold-fmnist-dirichlet-s0`` for a config whose every
    other setting is its default, else that plus a short hash of the settings that are not
    (``scaffold-fmnist-dirichlet-s0-3f9a0c21``), so two configs that differ in anything that changes the numbers
    (the server optimiser, an algorithm parameter, the learning rate) never share a folder, and ``--resume``
    with the same config finds it again. What may change on resume (``run.rounds``, display and worker keys,
    trackers) and where things are (``run.out_dir``, ``run.plugins``) are left out of the hash.

    Where no run is in that folder, a folder named by an earlier rule that holds a run of exactly this config is
    kept, so such runs still resume under ``fedhet run --resume``: the name without a hash (``Config.legacy_name``,
    before the hash existed), and the hash that counted the model chosen for the dataset as a setting."""
    base = cfg.legacy_name()
    digest = settings_hash(cfg)
    name = f"{base}-{digest}" if digest else base
    if _holds_run(Path(cfg.run.out_dir) / name):
        return name
    counted_model = settings_hash(cfg, model_default=DEFAULT_MODEL)
    earlier = [base, f"{base}-{counted_model}" if counted_model else base]
    return next((old for old in dict.fromkeys(earlier) if old != name and _holds_same_run(cfg, old)), name)


# settings left out of the name's hash: those a resume may change, where the run and its plug-ins are, the
# evaluation batch size, the trackers; the name itself
NAME_IGNORES = ("run.name", "run.out_dir", "run.plugins", *RESUMABLE_CHANGES, "run.eval_batch_size")
NAME_IGNORED_SECTIONS = ("tracking.",)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and prefix == "":
            out.update(_flatten(value, f"{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _resolved_and_defaults(cfg: Config, model_default: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config with every component parameter filled in, and the defaults to compare it with; where a component
    cannot be resolved (its plug-in not loaded yet, a wrong name: make_config words that), the config as given.
    ``model.name``'s default is the model that fits the dataset (models/fit.py), or ``model_default``."""
    defaults = _flatten(Config.model_construct().to_dict())
    defaults["model.name"] = model_default or default_model(cfg.dataset.name, cfg.dataset.params())
    raw = cfg.to_dict()
    try:
        plugins.load(cfg.run.plugins)
        for section, registry in component_registries():
            comp = getattr(cfg, section)
            entry, parsed = registry.parse(comp.name, comp.params())
            if parsed is not None:
                raw[section] = {**raw[section], "name": entry.name, **parsed.model_dump(mode="json")}
                try:
                    params = entry.params().model_dump(mode="json")
                except ValidationError:  # a parameter without a default: every value counts as set
                    params = {}
                defaults.update({f"{section}.{k}": v for k, v in params.items()})
    except (FedhetError, ImportError, ValueError):
        pass
    return raw, defaults


def identity_settings(cfg: Config, model_default: str | None = None) -> dict[str, Any]:
    """``"section.key" -> value`` of every setting (components resolved where they can be) that is not its default
    and is part of what a run computes: what ``default_name`` hashes. The names ``legacy_name`` shows (algorithm,
    dataset, partitioner, seed) are left out (they are in the name), and so is a ``partition.seed`` equal to
    ``run.seed`` (the same partition), and the model the dataset gets when the config names none (``model_default``
    replaces that default: names given before it counted)."""
    raw, defaults = _resolved_and_defaults(cfg, model_default)
    flat = _flatten(raw)
    if flat.get("partition.seed") == flat.get("run.seed"):
        flat["partition.seed"] = None
    shown_in_name = ("algorithm.name", "dataset.name", "partition.name", "run.seed")
    skip = (*NAME_IGNORES, *shown_in_name)
    return {
        key: value
        for key, value in sorted(flat.items())
        if key not in skip and not key.startswith(NAME_IGNORED_SECTIONS) and defaults.get(key, _MISSING) != value
    }


_MISSING = object()


def settings_hash(cfg: Config, model_default: str | None = None) -> str:
    """``NAME_HASH_CHARS`` hex characters of SHA-256 over the non-default settings, or "" when there are none."""
    settings = identity_settings(cfg, model_default)
    if not settings:
        return ""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:NAME_HASH_CHARS]


def _holds_run(folder: Path) -> bool:
    try:
        return holds_run(folder)
    except OSError:
        return False


def _holds_same_run(cfg: Config, name: str) -> bool:
    """Whether ``run.out_dir/name`` holds a run whose saved config is this one (as far as a resume compares them):
    a folder named before derived names had a hash."""
    folder = Path(cfg.run.out_dir) / name
    saved_path = folder / "config.json"
    if not _holds_run(folder) or not saved_path.is_file():
        return False
    try:
        saved = json.loads(saved_path.read_text(encoding="utf-8"))
        return isinstance(saved, dict) and not config_changes(saved, resolve_config(cfg))
    except (OSError, ValueError, TypeError, KeyError, FedhetError):
        return False


def check_config_paths(cfg: Config, *, writable: bool = False) -> None:
    """Every path a config names, as this machine sees it: ``dataset.data_dir`` (a folder, or absent for the dataset
    to report), ``run.out_dir`` and the run folder, the trackers' folders. Without ``writable`` only what exists is
    checked (a file where a folder belongs, a FIFO, a dangling link), so that commands that write no run (``fedhet
    partition``) are not refused for an output folder they never make; with it, each output folder must also be
    one this process can make or write in (``fedhet run`` before it starts). Plug-in files are checked as they load
    (fedhet/plugins.py), the config file as it is read (fedhet/config.py)."""
    if cfg.dataset.data_dir:
        check_folder(Path(cfg.dataset.data_dir).expanduser(), "dataset.data_dir")
    out_dir = Path(cfg.run.out_dir)
    run_dir = out_dir / run_name(cfg)
    outputs = [
        (out_dir, "run.out_dir", None, "the output folder"),
        (run_dir, "run folder", "run.out_dir/run.name", None),
    ]
    t = cfg.tracking
    if t.tensorboard:
        outputs.append((run_dir / "tensorboard", "TensorBoard folder", "tracking.tensorboard", None))
    files = []
    if t.mlflow:
        for path, what in mlflow_paths(t.mlflow_uri, out_dir):
            (files if what == "MLflow database" else outputs).append((path, what, "tracking.mlflow_uri", None))
    if t.wandb:
        outputs.append((Path(t.wandb_dir) if t.wandb_dir else out_dir, "W&B folder", "tracking.wandb_dir", None))
    for folder, what, setting, role in outputs:
        check_folder(folder, what, creatable=writable, setting=setting, role=role)
    for path, what, setting, role in files:  # the database: a regular file, or none yet
        if writable or os.path.lexists(path):
            check_output_file(path, what, setting=setting, role=role)
