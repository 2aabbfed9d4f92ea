"""What FedPer, FedBABU and FedBN share: parts of the flat parameter vector that the server never moves (the last
layers of the model as one slice; FedBN's BatchNorm layers as an index), and the indices of what a module owns.

A *layer* is a module that owns parameters directly (a Linear, a convolution, a normalisation layer), counted from
the output: layer 1 is the head, layer 2 the module just below it, and so on. ``FedModel`` registers the body before
the head, so the last ``k`` layers are the tail of the flat vector, one contiguous slice.

``KeptSlice`` is the server half: the replies are averaged as FedAvg does, except in the kept slice, where the global
values stay bit for bit whatever the server optimiser (FedPer: every client's initial personal layers; FedBABU: the
frozen random head).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from fedhet.algorithms.base import Reply, weighted_sum
from fedhet.errors import ConfigError
from fedhet.toolkit.flat import FlatModel

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer
    from fedhet.models.base import FedModel


def layer_spans(model: FedModel) -> list[tuple[str, slice]]:
    """Each module owning parameters directly, in flat order, with the span of its parameters."""
    spans: dict[str, slice] = {}
    for name, span in FlatModel(model).slices().items():
        owner = name.rpartition(".")[0]
        first = spans.get(owner, span)
        spans[owner] = slice(first.start, span.stop)  # a module's own parameters are adjacent in the flat order
    return list(spans.items())


def top_layers(build_model: Callable[[], FedModel], layers: int, key: str) -> tuple[slice, list[str]]:
    """The slice of the last ``layers`` layers and their module names; ``key`` names the setting in errors."""
    with torch.random.fork_rng(devices=[]):  # building draws weights; the run's random stream must not move
        spans = layer_spans(build_model())
    if layers > len(spans):
        raise ConfigError(
            f"{key}: must be at most {len(spans)}, the number of layers with parameters in this model (got {layers})"
        )
    tail = spans[-layers:]
    return slice(tail[0][1].start, tail[-1][1].stop), [name for name, _ in tail]


class KeptSlice:
    """Server side of an algorithm whose slice ``kept`` of the global vector never moves (mixed into FedAvg)."""

    kept: slice

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        weights = self.aggregation_weights(replies)
        target = weighted_sum([r.tensors["params"] for r in replies.values()], weights)
        self.global_params = step_keeping(self.server_opt, self.global_params, target, self.kept)
        self.average_buffers(replies, weights)
        return {}


def step_keeping(
    server_opt: ServerOptimizer, params: torch.Tensor, target: torch.Tensor, keep: slice | torch.Tensor
) -> torch.Tensor:
    """The server optimiser's step from ``params`` toward ``target`` with ``keep`` (a slice or an index tensor) left
    at its values: a zero pseudo-gradient there, and the old values put back after the step (an average of equal
    values need not round back to them, and no server optimiser may move them)."""
    target[keep] = params[keep]
    stepped = server_opt.step(params, target)
    stepped[keep] = params[keep]
    return stepped


def owned_indices(model: nn.Module, modules: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into the flat parameter and flat buffer vectors of what the named modules own directly (their
    weights and biases; their floating buffers, e.g. BatchNorm's running mean and variance)."""
    flat, owned = FlatModel(model), set(modules)

    def index(slices: dict[str, slice]) -> torch.Tensor:
        spans = [torch.arange(s.start, s.stop) for name, s in slices.items() if name.rpartition(".")[0] in owned]
        return (torch.cat(spans) if spans else torch.zeros(0, dtype=torch.long)).to(device)

    return index(flat.slices()), index(flat.buffer_slices())


def batchnorm_layers(model: nn.Module) -> list[str]:
    """The names of the model's BatchNorm modules (1d, 2d, 3d, synchronised), in registration order."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
