"""FedProx (Li et al. 2020): FedAvg plus a proximal term mu/2 ||w - w_global||^2 in every client's objective."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, ClientContext
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig


class FedProxConfig(FedAvgConfig):
    mu: float = Field(0.01, ge=0.0)  # Li et al. 2020 tune mu in {0.001, 0.01, 0.1, 1}; 0.01 is a common best
    tunable: ClassVar[dict[str, str]] = {"mu": "log:1e-3:1"}  # Li et al. 2020 (FedProx): mu in {0.001, 0.01, 0.1, 1}


@ALGORITHMS.register(
    "fedprox", "FedProx (Li et al. 2020): FedAvg with a proximal term mu/2 ||w - w_global||^2", FedProxConfig
)
class FedProx(FedAvg):
    name = "fedprox"
    Config = FedProxConfig
    batchable = True  # default loss, hooks on the flat vectors only (engine/batched.py)
    dp_sgd = True  # default loss; the proximal term is added after privatisation and reads no data

    def after_backward(self, ctx: ClientContext) -> None:
        # The gradient of mu/2 ||w - w_g||^2 is exact and cheap on the flat vectors; no autograd needed.
        ctx.flat.grad.add_(ctx.flat.params - ctx.global_params, alpha=self.config.mu)
