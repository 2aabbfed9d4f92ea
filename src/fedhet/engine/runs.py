"""Which loop trains a run: the synchronous rounds (``engine/simulation.py``) or, with ``server.mode = "fedbuff"``,
FedBuff's buffered asynchronous steps on the simulated clock (``engine/asynchronous.py``). Above both, so neither
imports the other; everything that starts a run builds it here."""

from __future__ import annotations

from typing import Any

from fedhet.config import Config
from fedhet.engine.asynchronous import BufferedSimulation
from fedhet.engine.simulation import Simulation


def build_simulation(cfg: Config, **kwargs: Any) -> Simulation:
    """``Simulation(cfg, **kwargs)``, or its FedBuff loop where ``server.mode = "fedbuff"``."""
    loop = BufferedSimulation if cfg.server.mode == "fedbuff" else Simulation
    return loop(cfg, **kwargs)
