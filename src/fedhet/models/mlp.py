"""Fully connected models: the MLP of FedAvg/FedBC and multinomial logistic regression (FedProx/FedBC)."""

from __future__ import annotations

import math

from pydantic import Field, PositiveInt
from torch import nn

from fedhet.errors import ConfigError
from fedhet.models.base import MODELS, FedModel, ModelParams


def input_size(model: str, input_shape: tuple[int, ...]) -> int:
    if not input_shape or any(d <= 0 for d in input_shape):
        raise ConfigError(f"model {model!r} needs a non-empty input shape, got {tuple(input_shape)}")
    return math.prod(input_shape)


class MLPParams(ModelParams):
    hidden: list[PositiveInt] = [200, 200]  # McMahan et al. 2017 "2NN"; FedBC's MNIST MLP is [128]
    dropout: float = Field(0.0, ge=0.0, lt=1.0)  # FedBC's MNIST MLP uses 0.5


@MODELS.register(
    "mlp",
    "MLP on flattened input (FedAvg 2NN 200-200; FedBC MNIST: hidden=[128], dropout=0.5)",
    params=MLPParams,
)
def build_mlp(input_shape: tuple[int, ...], num_classes: int, p: MLPParams) -> FedModel:
    width = input_size("mlp", input_shape)
    stages: dict[str, nn.Module] = {}
    for i, out in enumerate(p.hidden):
        # FedBC orders Linear-Dropout-ReLU; ReLU and inverted dropout commute, so this is the same function.
        layers = [nn.Flatten()] if i == 0 else []
        layers += [nn.Linear(width, out), nn.ReLU()] + ([nn.Dropout(p.dropout)] if p.dropout > 0 else [])
        stages[f"fc{i + 1}"] = nn.Sequential(*layers)
        width = out
    return FedModel(stages or {"flatten": nn.Flatten()}, width, num_classes)


class LogRegParams(ModelParams):
    pass


@MODELS.register(
    "logreg",
    "multinomial logistic regression, Linear(in, classes); FedProx/FedBC Synthetic",
    params=LogRegParams,
)
def build_logreg(input_shape: tuple[int, ...], num_classes: int, p: LogRegParams) -> FedModel:
    return FedModel({"flatten": nn.Flatten()}, input_size("logreg", input_shape), num_classes)
