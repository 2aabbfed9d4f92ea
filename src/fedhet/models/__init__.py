"""Model factories: `build_model(name, input_shape, num_classes, **params)` returns a `FedModel`."""

from __future__ import annotations

from pydantic import ValidationError

from fedhet.errors import ConfigError
from fedhet.models import cnn, lstm, mlp  # noqa: F401  (importing registers the models)
from fedhet.models.base import MODELS, FedModel, ModelParams

__all__ = ["MODELS", "FedModel", "ModelParams", "build_model"]


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, **params) -> FedModel:
    """Build a registered model; parameters are validated against the entry's pydantic model."""
    entry = MODELS.get(name)
    if num_classes < 1:
        raise ConfigError(f"model {entry.name!r} needs num_classes >= 1, got {num_classes}")
    try:
        p = (entry.params or ModelParams)(**params)
    except ValidationError as exc:
        raise ConfigError(params_error(entry.name, entry.params or ModelParams, exc)) from None
    return entry.obj(tuple(input_shape), num_classes, p)


def params_error(name: str, params_model, exc: ValidationError) -> str:
    """One line: the first problem, plus the valid parameter names when a key is unknown."""
    err = exc.errors()[0]
    key = ".".join(str(part) for part in err["loc"])
    valid = ", ".join(params_model.model_fields) or "none"
    if err["type"] == "extra_forbidden":
        return f"unknown parameter {key!r} for model {name!r}; valid parameters: {valid}"
    return f"model {name!r} parameter {key!r}: {err['msg']}"
