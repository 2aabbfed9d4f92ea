"""FedNTD (Lee, Jeong, Shin, Yun and Oh, NeurIPS 2022): not-true distillation from the global model.

Local loss = CE(z, y) + β τ² KL( softmax(g̃/τ) ‖ softmax(z̃/τ) ), where z are the local logits, g the logits of
the received global model (frozen, no gradient) on the same batch, and ~ removes the true-class column, so the
global model's knowledge about the *other* classes is kept while the true class is learnt freely. The KL is summed
over classes and averaged over the batch (``KLDivLoss(reduction="batchmean")``), as in the official
``Lee-Gihun/FedNTD`` ``algorithms/fedntd/criterion.py`` (the τ² factor is in its latest version; with the default
τ = 1 it changes nothing). The global model runs in eval mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Setup
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.algorithms.functional import Frozen

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer


class FedNTDConfig(FedAvgConfig):
    tau: float = Field(1.0, gt=0.0)  # official config/fedntd.json (the NTD_Loss class default is 3)
    beta: float = Field(1.0, ge=0.0)  # official config/fedntd.json; FedRCL runs FedNTD with 0.3 (App. E)
    # sensible defaults around the official tau = 1 (NTD_Loss default 3) and beta = 1 (FedRCL: 0.3)
    tunable: ClassVar[dict[str, str]] = {"tau": "log:0.5:5", "beta": "log:0.1:3"}


def not_true(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, C) logits -> (B, C - 1) without each row's true-class column, other columns in order (a gather, not a
    boolean mask, so vmap can batch it)."""
    columns = torch.arange(logits.shape[1] - 1, device=logits.device).expand(len(y), -1)
    return logits.gather(1, columns + (columns >= y[:, None]))


def ntd_loss(logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    """τ² KL(softmax(g̃/τ) ‖ softmax(z̃/τ)), summed over classes, averaged over the batch."""
    log_q = F.log_softmax(not_true(logits, y) / tau, dim=1)
    log_p = F.log_softmax(not_true(global_logits, y).detach() / tau, dim=1)
    return tau**2 * F.kl_div(log_q, log_p, reduction="batchmean", log_target=True)


@ALGORITHMS.register(
    "fedntd", "FedNTD (Lee et al. 2022): CE + not-true distillation from the global model", FedNTDConfig
)
class FedNTD(FedAvg):
    name = "fedntd"
    Config = FedNTDConfig
    batchable = True  # the teacher is the received model, an unbatched input (algorithms/functional.py)

    def __init__(self, config: FedNTDConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self._teacher: Frozen | None = None  # the architecture, run at the received model's parameters

    def loss_inputs(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        if self.config.beta == 0:
            return {}
        if self._teacher is None:
            self._teacher = Frozen(self.setup.build_model)
        return {"global": ctx.global_params, "global_buffers": ctx.message.tensors.get("buffers", torch.zeros(0))}

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        if "global" not in inputs:
            return loss
        global_logits = self._teacher(inputs["global"], inputs["global_buffers"], _forward, x)
        return loss + self.config.beta * ntd_loss(logits, global_logits, y, self.config.tau)


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)
