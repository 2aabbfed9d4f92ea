"""The model contract every algorithm relies on: a body mapping inputs to a flat embedding, and a linear head.

Algorithms that act on features (FedRoD's personal head, MOON's and FedRCL's contrastive terms, FedNH's
prototypes) need the embedding and sometimes intermediate stages. The body is a sequence of named stages run
one by one, so `forward_features` gets them without forward hooks, at the cost of a plain forward pass.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from pydantic import ConfigDict
from torch import Tensor, nn

from fedhet.errors import ConfigError
from fedhet.params import Params
from fedhet.registry import Registry

MODELS = Registry("model", section="model")


class ModelParams(Params):
    """Base of every model's parameters (unknown keys, non-finite floats and booleans for numbers are errors)."""

    model_config = ConfigDict(frozen=True)


class FedModel(nn.Module):
    """`head(body(x))` where `body` is an ordered sequence of named stages ending in a flat (B, D) embedding.

    `feature_names` lists the taps `forward_features` returns: every stage but the last (whose output *is* the
    embedding), then `"embedding"`. Stage names are stable because algorithms may refer to them.
    """

    def __init__(
        self, stages: dict[str, nn.Module], embedding_dim: int, num_classes: int, head_bias: bool = True
    ) -> None:
        super().__init__()
        if not stages:
            raise ValueError("a FedModel needs at least one body stage")
        self.body = nn.Sequential(OrderedDict(stages))
        self.head = nn.Linear(embedding_dim, num_classes, bias=head_bias)
        self.embedding_dim = embedding_dim
        self.num_classes = num_classes
        self.feature_names: tuple[str, ...] = (*list(stages)[:-1], "embedding")

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))

    def forward_features(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Logits plus every stage output; `features["embedding"]` is exactly the head's input."""
        features: dict[str, Tensor] = {}
        for name, stage in self.body.named_children():
            x = stage(x)
            features[name] = x
        last = next(reversed(self.body._modules))
        features["embedding"] = features.pop(last)
        return self.head(x), features


def check_rank(model: str, input_shape: tuple[int, ...], rank: int, example: str) -> None:
    if len(input_shape) != rank or any(d <= 0 for d in input_shape):
        raise ConfigError(f"model {model!r} needs an input shape like {example}, got {tuple(input_shape)}")


def flat_size(model: str, stages: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Size of the flattened output of `stages` for one input; a shape too small for them is a ConfigError."""
    try:
        with torch.no_grad():
            out = stages(torch.zeros(1, *input_shape))
    except RuntimeError as exc:
        shape = tuple(input_shape)
        raise ConfigError(f"model {model!r} cannot take inputs of shape {shape}: too small") from exc
    return out[0].numel()
