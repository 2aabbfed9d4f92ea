"""The config sections that name a registered component, with the registries they pick from.

Above the components (data, models, algorithms) and the config, below what resolves a config against them (the
engine, the run name's hash, the settings reference), so ``config.py`` never imports a registry."""

from __future__ import annotations

from fedhet.algorithms import ALGORITHMS, SERVER_OPTIMIZERS
from fedhet.data.datasets import DATASETS
from fedhet.data.partition import PARTITIONERS
from fedhet.models import MODELS
from fedhet.registry import Registry


def component_registries() -> tuple[tuple[str, Registry], ...]:
    """(section, registry) of every component section, in the order a config lists them."""
    return (
        ("dataset", DATASETS),
        ("partition", PARTITIONERS),
        ("model", MODELS),
        ("algorithm", ALGORITHMS),
        ("server", SERVER_OPTIMIZERS),
    )
