"""A method written outside fedhet: FedAvg whose clients train with label-smoothed cross-entropy.

Label smoothing (Szegedy et al., "Rethinking the Inception Architecture", CVPR 2016, section 7) trains against
(1 − ε)·onehot(y) + ε/C instead of the one-hot target, which keeps local models from growing over-confident on the few
classes a non-IID client holds. Everything else is FedAvg: the server averages the client models.

Use it from the command line or a TOML file without changing fedhet:

    fedhet run --plugin examples/label_smoothing.py -a fedavg_ls -s algorithm.smoothing=0.2 -d digits -m mlp
    fedhet flower simulate --plugin examples/label_smoothing.py -a fedavg_ls -d digits -m mlp -n 4
    fedhet list algorithms --plugin examples/label_smoothing.py

(docs/extending.md walks through it line by line.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms import ALGORITHMS, ClientContext
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig


class FedAvgLSConfig(FedAvgConfig):
    # ε = 0.1: the value Szegedy et al. use for ImageNet (section 7)
    smoothing: float = Field(0.1, ge=0.0, lt=1.0)


@ALGORITHMS.register("fedavg_ls", "FedAvg with label-smoothed local cross-entropy (example plug-in)", FedAvgLSConfig)
class FedAvgLS(FedAvg):
    name = "fedavg_ls"
    Config = FedAvgLSConfig

    def local_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(ctx.model(x), y, label_smoothing=self.config.smoothing)
