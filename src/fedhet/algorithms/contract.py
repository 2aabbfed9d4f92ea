"""The messages and contexts of the algorithm contract (``fedhet.algorithms.base``): what crosses the wire (``Message``,
``Reply``), what a client's hooks see (``ClientContext``) and what an algorithm is built with (``Setup``). Plain
dataclasses under both the contract's ``Algorithm`` class and the local loop that calls its hooks, so neither imports
the other's module in a circle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fedhet.data.types import ClientData

if TYPE_CHECKING:
    from fedhet.config import PrivacySection, TrainSection
    from fedhet.models.base import FedModel
    from fedhet.toolkit.flat import FlatModel

Scalar = float | int | str | bool

# The message scalar that caps a client's local steps this round (the system model's stragglers and deadline,
# engine/system.py): the shared loop and the batched executor train min(its full count, the budget) steps.
STEP_BUDGET = "local_steps"


def step_budget(message: Message, full: int) -> int:
    """The local steps a client trains: its full count, or fewer where the message carries a ``STEP_BUDGET``."""
    budget = message.scalars.get(STEP_BUDGET)
    return full if budget is None else min(full, int(budget))


@dataclass
class Message:
    """Server -> client payload."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)


@dataclass
class Reply:
    """Client -> server payload."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalar] = field(default_factory=dict)
    num_examples: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ClientContext:
    """Everything a client-side hook may use. The loop fills the mutable fields as it goes."""

    cid: int
    round: int
    phase: str
    message: Message
    data: ClientData
    state: dict[str, torch.Tensor]  # persistent client-held state; mutate in place, the engine stores it
    model: FedModel
    flat: FlatModel
    train: TrainSection
    generator: torch.Generator
    augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None
    lr: float = 0.0
    steps: int = 0  # local steps taken so far
    loss_sum: float = 0.0
    scratch: dict[str, Any] = field(default_factory=dict)  # per-round working values of a hook
    # indices into ``data`` of the mini-batch being trained on, set by the sequential loop before ``local_loss`` (for
    # per-sample values a hook computes once per round, e.g. FedUFO's teacher predictions); None outside the loop
    batch: torch.Tensor | None = None
    # a malicious client's data attack on each mini-batch, (x, y) -> (x, y), applied by the loop after augmentation
    poison: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    # run.compile: the loop's compiled step (algorithms.loop.CompiledGradient), where the algorithm's local_loss is the
    # contract's own; None: local_loss and backward() as written
    compiled: Callable[..., Any] | None = None

    @property
    def global_params(self) -> torch.Tensor:
        return self.message.tensors["params"]


@dataclass
class Setup:
    """What an algorithm is told about the federation when it is built (on server and client alike)."""

    num_clients: int
    num_classes: int
    train: TrainSection
    build_model: Callable[[], FedModel]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    privacy: PrivacySection | None = None  # the run's [privacy]: local DP-SGD is applied by the shared loop
