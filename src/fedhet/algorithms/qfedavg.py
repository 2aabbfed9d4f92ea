"""q-FedAvg (Li, Sanjabi, Beirami and Smith 2020, "Fair Resource Allocation in Federated Learning", Alg. 3).

q-FFL minimises sum_k p_k F_k^{q+1} / (q + 1), which weights clients with a high loss more. Client k computes
F_k = its mean training loss at the received model x (before training), trains locally as FedAvg does to x_k, and
with L = 1 / lr (the official code's Lipschitz estimate, ``lipschitz`` overrides it) replies

    Delta_k = F_k^q L (x - x_k),       h_k = q F_k^{q-1} ||L (x - x_k)||^2 + L F_k^q

(F_k + 1e-10 in the powers, as the official code). The server steps  x <- x - sum_k w_k Delta_k / sum_k w_k h_k,
through the server optimiser. q = 0 is FedAvg (with the same weights w_k).

Readings, as config:
* ``weighting``: "uniform" (w_k = 1) is q-FFL's Algorithm 3 and its official code (litian96/fair_flearn
  ``aggregate2``; there clients are sampled in proportion to their size). "samples" (w_k = n_k) is the FedBC code's
  q-FedAvg, which samples uniformly and weights both sums by client size.
* ``h_norm``: "scaled" uses ||L (x - x_k)||^2 as q-FFL (paper and ``norm_grad(grads)`` in its code); "unscaled"
  uses ||x - x_k||^2, as the FedBC code does (it never multiplies that norm by L^2).

Local optimiser: SGD only (``train.optimizer = "sgd"``): L (x - x_k) estimates the gradient only for gradient steps
of size 1 / L, as in the paper and its code, so Adam / AdamW are refused.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientContext, Reply, weighted_sum
from fedhet.toolkit.evaluate import evaluate

EPS = 1e-10  # official code: np.float_power(loss + 1e-10, q)


class QFedAvgConfig(AlgoConfig):
    q: float = Field(1.0, ge=0.0)  # FedBC synthetic_jobs.sh --q 1.0 (q-FFL tunes q per dataset)
    tunable: ClassVar[dict[str, str]] = {"q": "choice:1,2,5"}  # FedUFO's q-FFL runs (notes/fedufo.md): q in {1, 2, 5}
    weighting: Literal["uniform", "samples"] = "uniform"  # "uniform": q-FFL Alg. 3; "samples": the FedBC code
    h_norm: Literal["scaled", "unscaled"] = "scaled"  # "scaled": q-FFL; "unscaled": the FedBC code
    lipschitz: float | None = Field(None, gt=0.0)  # L; None = 1 / the round's client lr (q-FFL official code)


@ALGORITHMS.register(
    "qfedavg", "q-FedAvg (Li et al. 2020): loss^q-weighted updates with the h-normalised server step", QFedAvgConfig
)
class QFedAvg(Algorithm):
    name = "qfedavg"
    Config = QFedAvgConfig
    sgd_only = (
        "reads a client's update as a gradient, L (x - x_k) with L = 1 / lr, which holds for SGD steps and not for "
        "Adam's per-coordinate normalised steps"
    )
    unbatchable_reason = "before_local evaluates the received model through ctx.model"

    # ----------------------------------------------------------------- server side
    def aggregation_weights(self, replies: dict[int, Reply]) -> list[float]:
        if self.config.weighting == "uniform":
            return [1.0] * len(replies)
        return [float(r.num_examples) for r in replies.values()]

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        weights = self.aggregation_weights(replies)
        h_total = sum(w * float(r.scalars["h"]) for w, r in zip(weights, replies.values(), strict=True))
        step = weighted_sum([r.tensors["delta"] for r in replies.values()], [w / h_total for w in weights])
        self.global_params = self.server_opt.step(self.global_params, self.global_params - step)
        total = sum(weights)
        self.average_buffers(replies, [w / total for w in weights])
        return {}

    # ----------------------------------------------------------------- client side
    def before_local(self, ctx: ClientContext) -> None:
        stats = evaluate(ctx.model, ctx.data.x, ctx.data.y, ctx.data.num_classes, batch_size=1024)
        ctx.scratch["loss_before"] = stats.loss
        ctx.model.train()

    def after_local(self, ctx: ClientContext) -> Reply:
        reply = super().after_local(ctx)
        c = self.config
        lip = c.lipschitz if c.lipschitz is not None else 1.0 / ctx.lr
        loss = ctx.scratch["loss_before"] + EPS
        diff = ctx.global_params - reply.tensors.pop("params")
        grad = diff * lip  # Delta w_k = L (x - x_k)
        norm2 = float((grad if c.h_norm == "scaled" else diff).square().sum())
        reply.tensors["delta"] = grad * loss**c.q
        reply.scalars["h"] = c.q * loss ** (c.q - 1) * norm2 + lip * loss**c.q
        reply.metrics["loss_before"] = ctx.scratch["loss_before"]
        return reply
