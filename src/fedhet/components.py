"""The config sections that name a registered component, with the registries they pick from.

Above the components (data, models, algorithms) and the config, below what resolves a config against them (the
engine, the run name's hash, the settings reference), so ``config.py`` never imports a registry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedhet import plugins
from fedhet.algorithms import ALGORITHMS, SERVER_OPTIMIZERS
from fedhet.data.datasets import DATASETS
from fedhet.data.features import FEATURE_SKEWS
from fedhet.data.partition import PARTITIONERS
from fedhet.models import MODELS
from fedhet.registry import Registry

if TYPE_CHECKING:
    from fedhet.config import Config


def component_registries() -> tuple[tuple[str, Registry], ...]:
    """(section, registry) of every component section, in the order a config lists them."""
    return (
        ("dataset", DATASETS),
        ("partition", PARTITIONERS),
        ("features", FEATURE_SKEWS),
        ("model", MODELS),
        ("algorithm", ALGORITHMS),
        ("server", SERVER_OPTIMIZERS),
    )


def component_modules(cfg: Config) -> set[str]:
    """The modules that define the components ``cfg`` names, with those of a class's bases (a plug-in's algorithm
    that extends another plug-in's uses both)."""
    modules: set[str] = set()
    for section, registry in component_registries():
        obj = registry.get(getattr(cfg, section).name).obj
        for item in getattr(obj, "__mro__", (obj,)):
            modules.add(getattr(item, "__module__", None) or "")
    return modules - {""}


def plugins_in_use(cfg: Config) -> dict[str, Any]:
    """``plugins.fingerprints`` of the plug-ins that a run of ``cfg`` runs: those that define one of its components
    (a built-in FedAvg run beside a plug-in's method never executes the plug-in, so its edits do not concern it)."""
    return plugins.used_by(plugins.fingerprints(cfg.run.plugins), component_modules(cfg))
