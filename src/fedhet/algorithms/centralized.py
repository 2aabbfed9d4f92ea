"""Centralized training, the upper bound FL papers report (FedUFO's Tables 1, 2 and 6, "centralized").

One client holds every client's training data and trains the same model with the same local loop and optimiser
(``train.*``: batch size, learning rate, momentum, weight decay, epochs per round); the server takes its model as
it is (one reply: the weighted average is that model, and ``server = sgd`` with lr 1 keeps it). A round is therefore
``train.local_epochs`` epochs over the whole training set, not over one client's share.

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

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig
from fedhet.algorithms.fedavg import FedAvg


class CentralizedConfig(AlgoConfig):
    pass  # no parameters of its own: the run's train section is its optimiser (FedUFO: "same settings")


@ALGORITHMS.register(
    "centralized",
    "centralized upper bound: one client holds all training data; same model, loop and optimiser",
    CentralizedConfig,
)
class Centralized(FedAvg):
    name = "centralized"
    Config = CentralizedConfig
    pools_clients = True
    batchable = True  # FedAvg's default loss and hooks
