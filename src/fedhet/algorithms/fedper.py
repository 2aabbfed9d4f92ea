"""FedPer (Arivazhagan, Aggarwal, Singh and Choudhary 2019, "Federated Learning with Personalization Layers",
arXiv 1912.00818).

The model is split into base layers, shared and averaged as in FedAvg, and the top K_P *personalisation layers*,
which each client keeps and trains on its own data and never sends. A client's round, with W_B the global base and
W_P,i its own personalisation layers:

    (W_B, W_P,i) <- local SGD epochs on CE(f(x; W_B, W_P,i), y) over the client's data, every layer trained
    reply W_B only;   server: W_B <- sum_i n_i W_B,i / sum_i n_i

``personal_layers`` = K_P counts layers with parameters from the output (``algorithms/partial.py``): 1 is the head
alone (PFLlib's FedPer, the code base of FedRANE's Table 2, and the official FedBABU repository's FedPer baseline,
``--local_upt_part full --aggr_part body``); the paper studies K_P = 1 and 2. The personalisation layers live in
client state (``ctx.state["personal"]``), as FedRoD's personal head does: the client loads them after the received
model, stores them after training and replies with the received values in their slice; the server keeps its slice
as it is (``KeptSlice``). A client that has never trained starts from the global values there, the model's initial
layers, as every PFLlib client starts from the same initial model.

Personalised model (P-FL, FedRANE's Table 2): the current global base with the client's own personalisation layers,
which is exactly the model a PFLlib FedPer client holds when the server evaluates it (right after receiving the base).
A client that has never trained has none and is counted as never sampled.

Global model. FedRANE reports FedPer under P-FL only, and PFLlib's FedPer server holds and evaluates no global model
(it aggregates ``client.model.base`` only and evaluates the clients' own models). Here the global vector is the
averaged base with the *initial* personalisation layers (what a new client starts from), so the engine's
``test_acc`` for FedPer is the base under an untrained head: a diagnostic, not a FedPer result.

Differences from the references:

* Aggregation weights: by client samples (``weighting = "samples"``, PFLlib and the paper's FedAvg); the official
  FedBABU repository's FedPer averages uniformly (``weighting = "uniform"``).
* Buffers (BatchNorm running statistics): those of the personalisation layers are personal too (the buffer rule's
  ``kept_buffers``: kept in ``ctx.state["personal_buffers"]``, never moved by the server, and used to score the
  personalised model), the others are averaged with the base. PFLlib's personal ``head`` is a Linear layer, which
  has none; a personalisation layer with BatchNorm appears with ``personal_layers`` >= 2 on a model such as
  ``cnn_bn``.
* Optimiser: the shared loop's (``train``'s momentum, weight decay and clipping act on all layers, personal ones
  included); PFLlib uses plain SGD, the FedBABU repository SGD with momentum 0.9.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Reply, Setup
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.algorithms.partial import KeptSlice, owned_indices, top_layers

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer

PERSONAL = "personal"  # the client-state key of the personalisation layers' values
PERSONAL_BUFFERS = "personal_buffers"  # and of their buffers (BatchNorm statistics), where they have any


class FedPerConfig(FedAvgConfig):  # weighting "samples": PFLlib's aggregation (official FedBABU repo: uniform)
    # K_P, layers with parameters counted from the output: 1 = the head (PFLlib's FedPer, FedBABU repo's FedPer);
    # the paper uses K_P = 1 and 2
    personal_layers: int = Field(1, ge=1)


@ALGORITHMS.register(
    "fedper",
    "FedPer (Arivazhagan et al. 2019): base layers averaged, the top personalisation layers kept on each client",
    FedPerConfig,
)
class FedPer(KeptSlice, FedAvg):
    name = "fedper"
    head_refusal = (
        "keeps its personalisation layers, the last layers that train, on each client; with the head frozen "
        "they would be body layers"
    )
    Config = FedPerConfig
    personalized = True
    batchable = True  # default loss, hooks on the flat vectors and the state only (engine/batched.py)

    def __init__(self, config: FedPerConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self.kept, self.personal_modules = top_layers(
            setup.build_model, config.personal_layers, "algorithm.personal_layers"
        )
        with torch.random.fork_rng(devices=[]):  # building draws weights; the run's random stream must not move
            _, kept = owned_indices(setup.build_model(), self.personal_modules, setup.device)
        self.kept_buffers = kept if kept.numel() else None  # the buffer rule: these stay on the clients

    # ----------------------------------------------------------------- server side: KeptSlice.aggregate

    # ----------------------------------------------------------------- client side
    def before_local(self, ctx: ClientContext) -> None:
        own = ctx.state.get(PERSONAL)
        if own is not None:
            ctx.flat.params[self.kept] = own
        if PERSONAL_BUFFERS in ctx.state:
            ctx.flat.buffers[self.kept_buffers] = ctx.state[PERSONAL_BUFFERS]

    def after_local(self, ctx: ClientContext) -> Reply:
        ctx.state[PERSONAL] = ctx.flat.params[self.kept].clone()
        ctx.flat.params[self.kept] = ctx.global_params[self.kept]  # the personalisation layers never leave
        if self.kept_buffers is not None:
            ctx.state[PERSONAL_BUFFERS] = ctx.flat.buffers[self.kept_buffers].clone()
            ctx.flat.buffers[self.kept_buffers] = ctx.message.tensors["buffers"][self.kept_buffers]
        return super().after_local(ctx)

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        """The current global base with this client's own personalisation layers."""
        own = ctx.state.get(PERSONAL)
        if own is None:
            return None
        params = ctx.global_params.clone()
        params[self.kept] = own
        return params

    def personal_buffers(self, ctx: ClientContext) -> torch.Tensor | None:
        """The global buffers with this client's own statistics in its personalisation layers."""
        buffers = super().personal_buffers(ctx)
        if buffers is None or PERSONAL_BUFFERS not in ctx.state:
            return buffers
        buffers = buffers.clone()
        buffers[self.kept_buffers] = ctx.state[PERSONAL_BUFFERS]
        return buffers
