"""Federated algorithms. Importing this package registers every algorithm in ``ALGORITHMS``."""

from fedhet.algorithms import fedavg, fedprox  # noqa: F401  (registration side effects)
from fedhet.algorithms.base import ALGORITHMS, Algorithm, ClientContext, Message, Reply, Setup
from fedhet.algorithms.server_opt import SERVER_OPTIMIZERS, build_server_optimizer

__all__ = [
    "ALGORITHMS",
    "SERVER_OPTIMIZERS",
    "Algorithm",
    "ClientContext",
    "Message",
    "Reply",
    "Setup",
    "build_server_optimizer",
]
