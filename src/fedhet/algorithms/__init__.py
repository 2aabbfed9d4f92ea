"""Federated algorithms. Importing this package imports every module in it, which registers each algorithm in
``ALGORITHMS`` (one file per algorithm; adding a file is all it takes)."""

import importlib
import pkgutil

from fedhet.algorithms.base import ALGORITHMS, Algorithm, ClientContext, Message, Reply, Setup
from fedhet.algorithms.server_opt import SERVER_OPTIMIZERS, build_server_optimizer

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

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
