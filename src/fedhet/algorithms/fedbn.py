"""FedBN (Li, Jiang, Zhang, Kamp and Dou, ICLR 2021, "FedBN: Federated Learning on Non-IID Features via Local Batch
Normalization", arXiv 2102.07623).

Every BatchNorm layer stays on its client: its parameters (weight gamma, bias beta) and its statistics (running mean,
running variance, ``num_batches_tracked``) are the client's own, trained and updated only by local training, and
never sent. Everything else is averaged as in FedAvg. A client's round, with W the shared layers and B_i its own
BatchNorm layers:

    (W_i, B_i) <- local SGD epochs on CE(f(x; W, B_i), y), from the global W and the client's own B_i
    reply W_i only;   server: W <- sum_i p_i W_i  (p_i = n_i / sum_j n_j, or 1/K with ``weighting = "uniform"``)

The BatchNorm layers live in client state (``ctx.state``: ``bn_params``, ``bn_buffers``, ``bn_batches``): the
client loads them after the received model, stores them after training and replies with the received values in
their place; the server keeps its own there bit for bit, whatever the server optimiser (``partial.step_keeping``,
and the buffer rule's ``kept_buffers``, ``Algorithm.average_buffers``). A client that has never trained starts from
the server's values, the model's initial BatchNorm layers (gamma 1, beta 0, mean 0, variance 1), as every client
of the official code starts from the same initial model.

Evaluation. With local BatchNorm there is no one global model: the official code (``med-air/FedBN``,
``federated/fed_digits.py``) tests each client's model (the averaged layers with that client's own BatchNorm layers)
on that client's own test set and reports the per-client accuracies and their mean. That is FedBN's result here:
the personalised accuracy (``personal_acc_micro`` / ``personal_acc_macro``, which needs local test splits,
``partition.local_test_fraction`` or ``partition.local_test = "matched"``), each client's personalised model being the
current averaged layers with its own BatchNorm parameters and statistics. The engine's ``test_acc`` scores the
averaged layers with the initial BatchNorm layers (what a new client starts from) on the global test set: a
diagnostic, not a FedBN result. A client that has never trained has no BatchNorm layers of its own and is counted
as never sampled. A client's statistics were gathered under its own trained layers, not the averaged ones it is
scored with (as in the official evaluation), so with large local drift they fit poorly and the personalised
accuracy swings: ``fedhet run -d digits -a fedbn -m cnn_bn -s 'model.channels=[16,16,32]' -s 'model.hidden=[64,32]'
-n 6 -r 15 -s partition.local_test_fraction=0.2 -s train.batch_size=32 -s train.lr=0.02`` reaches 94 % by round 15
with ``-p iid`` (feature-alike clients, FedBN's setting) and swings between 12 and 40 % after round 1 under
Dirichlet 0.5 labels.

Which layers: every BatchNorm module of the model (``nn.BatchNorm1d/2d/3d``). The official code keeps the state-dict
keys containing ``bn``, which in its models are exactly the BatchNorm layers. A model without BatchNorm is refused
(FedBN would be FedAvg): ``cnn_bn`` is the paper's digit model, ``resnet`` has BatchNorm with ``model.norm = "batch"``.

Defaults and differences from the official code:

* Aggregation weights by client samples (``weighting = "samples"``, FedAvg's); the official digits code weights each
  client 1/K, the same thing for its equally sized clients (``weighting = "uniform"`` gives 1/K in general).
* Optimiser: the shared loop's (``train``'s lr, momentum, weight decay, clipping on every layer, the client's
  BatchNorm layers included); the official code uses plain SGD at lr 0.01, batch size 32, one local epoch per round.
* ``num_batches_tracked`` (which BatchNorm reads only with ``momentum = None``) is kept per client too, in
  ``ctx.state``; no other algorithm exchanges it.
* Sequential clients only: the batched executor cannot train BatchNorm statistics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Reply, Setup
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.algorithms.partial import batchnorm_layers, owned_indices, step_keeping
from fedhet.errors import ConfigError

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer

# client-state keys: the BatchNorm layers' parameters, floating statistics, and num_batches_tracked counters
PARAMS, BUFFERS, BATCHES = "bn_params", "bn_buffers", "bn_batches"


class FedBNConfig(FedAvgConfig):  # weighting "samples"; official digits code: 1/K over equally sized clients
    pass


@ALGORITHMS.register(
    "fedbn",
    "FedBN (Li et al. 2021): BatchNorm parameters and statistics stay on each client, the other layers averaged",
    FedBNConfig,
)
class FedBN(FedAvg):
    name = "fedbn"
    Config = FedBNConfig
    personalized = True
    weighted_aggregate = True  # aggregate's target is aggregate_target (server.aggregation = "gne" applies)
    unbatchable_reason = "keeps BatchNorm statistics, which the batched executor cannot train"

    def __init__(self, config: FedBNConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        with torch.random.fork_rng(devices=[]):  # building draws weights; the run's random stream must not move
            model = setup.build_model()
        self.layers = batchnorm_layers(model)
        if not self.layers:
            raise ConfigError(
                "algorithm 'fedbn' keeps each client's BatchNorm layers, and this model has none: use a model with "
                'BatchNorm (model.name = "cnn_bn", or "resnet" with model.norm = "batch")'
            )
        self.local_params, kept = owned_indices(model, self.layers, setup.device)
        self.kept_buffers = kept if kept.numel() else None  # the buffer rule: these stay on the clients

    # ----------------------------------------------------------------- server side
    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        weights = self.aggregation_weights(replies)
        target = self.aggregate_target(replies, weights)
        self.global_params = step_keeping(self.server_opt, self.global_params, target, self.local_params)
        self.average_buffers(replies, weights)  # kept_buffers: the server's BatchNorm statistics never move
        return {}

    # ----------------------------------------------------------------- client side
    def counters(self, model: nn.Module) -> list[torch.Tensor]:
        """The BatchNorm layers' ``num_batches_tracked`` (integer buffers, outside the flat vectors)."""
        modules = dict(model.named_modules())
        return [modules[n].num_batches_tracked for n in self.layers if modules[n].num_batches_tracked is not None]

    def before_local(self, ctx: ClientContext) -> None:
        own = ctx.state.get(BATCHES)
        for i, counter in enumerate(self.counters(ctx.model)):  # never another client's count
            counter.fill_(0 if own is None else int(own[i]))
        if PARAMS not in ctx.state:
            return  # never trained: the received (initial) BatchNorm layers
        ctx.flat.params[self.local_params] = ctx.state[PARAMS]
        if self.kept_buffers is not None:
            ctx.flat.buffers[self.kept_buffers] = ctx.state[BUFFERS]

    def after_local(self, ctx: ClientContext) -> Reply:
        ctx.state[PARAMS] = ctx.flat.params[self.local_params].clone()
        ctx.flat.params[self.local_params] = ctx.global_params[self.local_params]  # they never leave the client
        if self.kept_buffers is not None:
            ctx.state[BUFFERS] = ctx.flat.buffers[self.kept_buffers].clone()
            ctx.flat.buffers[self.kept_buffers] = ctx.message.tensors["buffers"][self.kept_buffers]
        counters = self.counters(ctx.model)
        if counters:
            ctx.state[BATCHES] = torch.stack(counters).clone()
        return super().after_local(ctx)

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        """The current averaged layers with this client's own BatchNorm parameters (None: it never trained)."""
        if PARAMS not in ctx.state:
            return None
        params = ctx.global_params.clone()
        params[self.local_params] = ctx.state[PARAMS]
        return params

    def personal_buffers(self, ctx: ClientContext) -> torch.Tensor | None:
        """The global buffers with this client's own BatchNorm statistics."""
        buffers = super().personal_buffers(ctx)
        if buffers is None or self.kept_buffers is None or BUFFERS not in ctx.state:
            return buffers
        buffers = buffers.clone()
        buffers[self.kept_buffers] = ctx.state[BUFFERS]
        return buffers
