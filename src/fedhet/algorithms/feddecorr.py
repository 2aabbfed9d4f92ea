"""FedDecorr (Shi, Liang, Zhang, Wang, Tan and Feng, ICLR 2023): decorrelate the representation to fight
dimensional collapse under heterogeneous data.

Local loss = CE + β · L_decorr(z), z the (B, D) embedding that feeds the classifier. L_decorr follows the official
``bytedance/FedDecorr`` ``loss.py`` (notes/official-code.md section 10): standardise each dimension over the batch,
(z − mean) / sqrt(1e-8 + var) with the unbiased variance, form K = zᵀz (not divided by B), take the mean of the
squared off-diagonal entries of K and divide by B; a batch of one gives 0. (The paper writes ‖K‖²_F / d² of the
correlation matrix; the code's normalisation is what its numbers come from.)
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedhet.algorithms.base import ALGORITHMS
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig


class FedDecorrConfig(FedAvgConfig):
    # β = 0.1: official run_scripts (--feddecorr_coef 0.1) and the paper's default; FedRCL uses 0.01 (App. E).
    beta: float = Field(0.1, ge=0.0)
    tunable: ClassVar[dict[str, str]] = {"beta": "log:1e-2:1"}  # sensible default: a decade either side of 0.1


def decorrelation_loss(z: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    n, d = z.shape
    if n == 1:
        return z.sum() * 0
    z = z - z.mean(0, keepdim=True)
    z = z / torch.sqrt(eps + z.var(0, keepdim=True))
    corr = z.T @ z
    # the mean over the off-diagonal entries, written without boolean indexing (which vmap cannot batch)
    squares = corr.pow(2)
    return (squares.sum() - squares.diagonal().sum()) / (d * (d - 1)) / n


@ALGORITHMS.register(
    "feddecorr",
    "FedDecorr (Shi et al. 2023): CE + beta * decorrelation of the embedding dimensions",
    FedDecorrConfig,
)
class FedDecorr(FedAvg):
    name = "feddecorr"
    Config = FedDecorrConfig
    batchable = True  # batch statistics only within a client's own batch (algorithms/functional.py)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        embedding = model.body(x)
        loss = F.cross_entropy(model.head(embedding), y)
        return loss + self.config.beta * decorrelation_loss(embedding)
