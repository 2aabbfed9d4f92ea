"""Model factories: `build_model(name, input_shape, num_classes, **params)` returns a `FedModel`."""

from __future__ import annotations

from fedhet.errors import ConfigError
from fedhet.models import cnn, lstm, mlp, resnet  # noqa: F401  (importing registers the models)
from fedhet.models.base import MODELS, FedModel, ModelParams
from fedhet.registry import parse_params

__all__ = ["MODELS", "FedModel", "ModelParams", "build_model", "check_model_fits"]


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **params) -> FedModel:
    """Build a registered model; parameters are validated against the entry's pydantic model."""
    entry = MODELS.get(name)
    if num_classes < 1:
        raise ConfigError(f"model {entry.name!r} needs num_classes >= 1, got {num_classes}")
    p = parse_params("model", entry.name, entry.params or ModelParams, params)
    return entry.obj(tuple(input_shape), num_classes, p)


def check_model_fits(cfg, fed, device) -> None:
    """A ``ConfigError`` before training when the run's model cannot fit in ``device``'s memory (engine/memory.py);
    the model is counted on torch's meta device, nothing is allocated."""
    from fedhet.engine.memory import check_model_fits as check

    check(cfg, fed, device)
