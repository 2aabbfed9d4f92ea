"""Model factories: `build_model(name, input_shape, num_classes, **params)` returns a `FedModel`."""

from __future__ import annotations

from fedhet.errors import ConfigError
from fedhet.models import backbones, cnn, lstm, mlp, resnet  # noqa: F401  (importing registers the models)
from fedhet.models.base import MODELS, FedModel, ModelParams
from fedhet.registry import parse_params

__all__ = ["MODELS", "FedModel", "ModelParams", "build_model"]


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **params) -> FedModel:
    """Build a registered model; parameters are validated against the entry's pydantic model."""
    entry = MODELS.get(name)
    if num_classes < 1:
        raise ConfigError(f"model {entry.name!r} needs num_classes >= 1, got {num_classes}")
    p = parse_params("model", entry.name, entry.params or ModelParams, params)
    return entry.obj(tuple(input_shape), num_classes, p)
