"""FedLC (Zhang, Li, Li, Xu and Wu, ICML 2022): federated learning with logit calibration for label skew.

Each client subtracts τ · n_c^{-1/4} from the logit of class c, n_c being the number of class-c samples in its
local training set, and trains with ordinary cross-entropy on the calibrated logits:

    L = −log( e^{z_y − τ n_y^{-1/4}} / Σ_c e^{z_c − τ n_c^{-1/4}} ).

The true class stays in the denominator. The paper's printed loss leaves it out, and training that way collapses
(KarhouTam/FL-bench#5, notes/frameworks.md section 3.4). A class absent from the client has n_c = 0, so its
calibrated logit is −∞ and it gets zero probability and no gradient, as in the port in ``bytedance/FedDecorr``
(``approach/fedlogitcal.py``: ``out -= temp * class2data ** (-0.25)``). Evaluation uses the raw logits.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedhet.algorithms.base import ALGORITHMS, ClientContext
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig


class FedLCConfig(FedAvgConfig):
    # τ = 1: FedRCL's setting for FedLC (Seo et al. 2024, App. E) and FL-bench's default; FedDecorr's port uses 0.1.
    tau: float = Field(1.0, gt=0.0)
    tunable: ClassVar[dict[str, str]] = {"tau": "log:1e-1:10"}  # sensible default: 0.1 (FedDecorr) to 10, around 1


def calibration(counts: torch.Tensor, tau: float) -> torch.Tensor:
    """τ n_c^{-1/4} per class; +inf for classes the client does not hold (their logits become -inf)."""
    return tau * counts.pow(-0.25)


def calibrated_cross_entropy(logits: torch.Tensor, y: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits - shift, y)


@ALGORITHMS.register(
    "fedlc", "FedLC (Zhang et al. 2022): cross-entropy on logits calibrated by local label counts", FedLCConfig
)
class FedLC(FedAvg):
    name = "fedlc"
    Config = FedLCConfig
    batchable = True  # its loss reads one per-client tensor (algorithms/functional.py)

    def before_local(self, ctx: ClientContext) -> None:
        ctx.scratch["fedlc_shift"] = calibration(ctx.data.label_counts(), self.config.tau)

    def loss_inputs(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        return {"shift": ctx.scratch["fedlc_shift"]}

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return calibrated_cross_entropy(model(x), y, inputs["shift"])
