"""Centralized training, the upper bound FL papers report (FedUFO's Tables 1, 2 and 6, "centralized").

One client holds every client's training data and trains the same model with the same local loop and optimiser
(``train.*``: batch size, learning rate, momentum, weight decay, epochs per round); the server takes its model as
it is (one reply: the weighted average is that model, and ``server = sgd`` with lr 1 keeps it). A round is therefore
``train.local_epochs`` epochs (or its own ``local_epochs``) over the whole training set, not one client's share.

Evaluation is measured on the partition's clients as for every federated method (``Simulation.eval_fed``): the
global test accuracy, and the per-client accuracies (best / worst / std, on the clients' local test data) that
FedUFO's fairness table reports for "centralized" as well. That is why it is an algorithm rather than a partition:
a comparison lists it as one more variant of the same setting (same partition, seed and local test data), and the
report groups and tables it like the others.

Deviation: the papers do not say how many epochs their centralized runs took; here they follow ``run.rounds`` x
``train.local_epochs``. It needs every client's data in one process, so it runs in the simulation only (a Flower run
refuses it).
"""

from __future__ import annotations

from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, ClientContext, Reply
from fedhet.algorithms.fedavg import FedAvg


class CentralizedConfig(AlgoConfig):
    # Epochs over the pooled data per round; None = train.local_epochs. Everything else is the run's train section
    # (FedUFO: the same settings for every method). FedUFO does not say how long its centralized run trained: with
    # its E = 10, one round over all 100 clients' data is 100 times the steps of a federated round at C = 0.1, so
    # the reproduction configs set 1 epoch per round (100 rounds = 100 epochs; our choice).
    local_epochs: float | None = Field(None, gt=0.0)


@ALGORITHMS.register(
    "centralized",
    "centralized upper bound: one client holds all training data; same model, loop and optimiser",
    CentralizedConfig,
)
class Centralized(FedAvg):
    name = "centralized"
    Config = CentralizedConfig
    unbatchable_reason = "trains one client holding all the data: nothing to batch"
    pools_clients = True

    def client_update(self, ctx: ClientContext) -> Reply:
        if self.config.local_epochs is not None:
            ctx.train = ctx.train.model_copy(update={"local_epochs": self.config.local_epochs, "local_steps": None})
        return super().client_update(ctx)
