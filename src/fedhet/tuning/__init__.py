"""Hyper-parameter tuning on validation data (docs/tuning.md): search spaces declared next to each component's
parameters (``space.py``); the objective a tuner reads is ``fedhet.results.objective`` (validation metrics only)."""

from fedhet.tuning.space import (
    Choice,
    Dimension,
    IntRange,
    LogUniform,
    SearchSpace,
    Uniform,
    build_space,
    configured,
    default_space,
    overrides,
    parse_distribution,
    tunable_parameters,
)

__all__ = [
    "Choice",
    "Dimension",
    "IntRange",
    "LogUniform",
    "SearchSpace",
    "Uniform",
    "build_space",
    "configured",
    "default_space",
    "overrides",
    "parse_distribution",
    "tunable_parameters",
]
