"""FedNova (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization").

Clients run plain local SGD (with the run's momentum / Nesterov / weight decay and, optionally, FedProx's proximal
term) for however many steps their data gives them, and reply with their cumulative update d_i = x - y_i and its
normaliser a_i (the sum of the coefficients with which the local gradients enter d_i / lr). The server removes the
bias towards clients that took more steps by averaging the normalised updates d_i / a_i:

    p_i = n_i / sum_j n_j,   tau_eff = sum_i p_i a_i,   x <- x - tau_eff * sum_i p_i d_i / a_i.

The step goes through the server optimiser (target = the right-hand side above), so ``server.lr`` scales it and
FedAvgM reproduces the official code's global momentum ``gmf``.

Reading of the official code (JYWa/FedNova, distoptim/FedNova.py, ``FedNova.step``), which we follow for the
proximal term. With heavy-ball momentum its ``d_p`` is the momentum buffer itself (``d_p = buf``), so adding
mu (x - x_0) to ``d_p`` adds it into the buffer, where it is carried on with weight rho into every later step:

    buf_t = rho buf_{t-1} + g_t + mu (x_t - x_0),   x_{t+1} = x_t - eta buf_t      (buf_1 = g_1 + mu (x_1 - x_0)).

We do the same by adding the proximal gradient to the loss gradient before the optimiser step (``after_backward``).
Without momentum, and with Nesterov momentum (where ``d_p = g + rho buf`` is a new tensor), the term is added to the
step only, never to the buffer; we add it after the step (``after_step``). The normaliser with a proximal term is the
official recursion verbatim, per step:

    counter = rho counter + 1 and vec += counter (only when rho != 0);   vec = vec (1 - eta mu) + 1.

With momentum this adds 1 per step on top of the counter; it is not the coefficient sum of the dynamics above (a unit
gradient moves x by lr * a_i only without momentum), but it is what the paper's FedProx + FedNova numbers used.
Before this reading fedhet kept the term out of the buffer and used vec = vec (1 - eta mu) + counter, which changes
the results of FedNova with mu > 0 and momentum (measured at K = 10, rho = 0.9, mu = 0.5, lr = 0.1: a = 41.5 now,
35.2 before). Without a proximal term: with Nesterov momentum the official code keeps the heavy-ball normaliser; we
use the exact one (each step's direction is g + rho * buf, so it adds 1 + rho * counter). Weight decay counts as part
of the gradient, as in the official code; ``train.grad_clip`` (which the official code does not have) clips the
gradient including the proximal term where that term enters the buffer. The official code sets tau_eff from the raw
step counts when mu != 0; we keep tau_eff = sum_i p_i a_i as in the paper.

Local optimiser: SGD only (``train.optimizer = "sgd"``). The paper's local solvers are linear in the gradients
(d_i = lr G_i a_i); Adam's update is not, so a_i does not exist and Adam / AdamW are refused.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientContext, Reply, weighted_sum

if TYPE_CHECKING:
    from fedhet.config import TrainSection


class FedNovaConfig(AlgoConfig):
    # JYWa/FedNova: FedNova(mu=0) is plain FedNova; mu > 0 adds FedProx's proximal term (the paper's FedProx+FedNova),
    # applied as the official step() applies it (into the momentum buffer under heavy-ball momentum)
    mu: float = Field(0.0, ge=0.0)
    # FedProx's grid for the proximal term of FedProx+FedNova (Li et al. 2020); 0 (plain FedNova) by -t choice
    tunable: ClassVar[dict[str, str]] = {"mu": "log:1e-3:1"}


def effective_steps(steps: int, momentum: float = 0.0, nesterov: bool = False) -> float:
    """sum over the steps of the coefficients of the gradients in the local update (no proximal term), closed form.

    Heavy-ball momentum rho (buffer reset each round): (tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho), the
    a_i of Wang et al. 2020 and of Lee-Gihun/FedNTD's FedNova server. Nesterov adds rho times that to tau.
    """
    if not momentum:
        return float(steps)
    heavy_ball = (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum)
    return steps + momentum * heavy_ball if nesterov else heavy_ball


def normaliser(steps: int, momentum: float = 0.0, nesterov: bool = False, eta_mu: float = 0.0) -> float:
    """FedNova's a_i for ``steps`` local steps; ``eta_mu`` = lr * mu of the proximal term.

    With a proximal term this is JYWa/FedNova's per-step recursion verbatim (the heavy-ball counter also under
    Nesterov momentum, as there); see the module docstring."""
    if not eta_mu:
        return effective_steps(steps, momentum, nesterov)
    counter = vec = 0.0
    for _ in range(steps):
        if momentum:
            counter = counter * momentum + 1
            vec += counter
        vec = vec * (1 - eta_mu) + 1
    return vec


def prox_in_buffer(train: TrainSection) -> bool:
    """Whether the official step carries the proximal term in the momentum buffer (heavy-ball momentum only)."""
    return bool(train.momentum) and not train.nesterov


@ALGORITHMS.register(
    "fednova",
    "FedNova (Wang et al. 2020): average of step-normalised client updates, rescaled by tau_eff",
    FedNovaConfig,
)
class FedNova(Algorithm):
    name = "fednova"
    Config = FedNovaConfig
    sgd_only = (
        "divides each client's update by a_i, the sum of the coefficients with which its gradients enter it, which "
        "exists for SGD (momentum, Nesterov, a proximal term) and not for Adam's per-coordinate normalised steps"
    )
    batchable = True  # default loss, hooks on the flat vectors only (engine/batched.py)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tau_eff = math.nan

    # ----------------------------------------------------------------- client side
    def after_backward(self, ctx: ClientContext) -> None:
        if not self.config.mu:
            return
        prox = (ctx.flat.params - ctx.global_params).mul_(self.config.mu)
        if prox_in_buffer(ctx.train):
            ctx.flat.grad.add_(prox)  # enters the momentum buffer, as JYWa/FedNova's aliased d_p does
        else:
            ctx.scratch["prox"] = prox  # applied after the step, outside the buffer (after_step)

    def after_step(self, ctx: ClientContext) -> None:
        if "prox" in ctx.scratch:
            ctx.flat.params.sub_(ctx.scratch.pop("prox"), alpha=ctx.lr)

    def after_local(self, ctx: ClientContext) -> Reply:
        reply = super().after_local(ctx)
        y = reply.tensors.pop("params")
        t = ctx.train
        a = normaliser(ctx.steps, t.momentum, t.nesterov, ctx.lr * self.config.mu)
        if not (math.isfinite(a) and a > 0):
            raise FloatingPointError(f"FedNova normaliser a_i = {a}: lr * mu = {ctx.lr * self.config.mu} is too large")
        reply.tensors["cum_update"] = ctx.global_params - y
        reply.scalars["a"] = a
        return reply

    # ----------------------------------------------------------------- server side
    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        p = self.aggregation_weights(replies)  # n_i / sum n over the clients that replied
        a = [float(r.scalars["a"]) for r in replies.values()]
        self.tau_eff = sum(pi * ai for pi, ai in zip(p, a, strict=True))
        coefs = [self.tau_eff * pi / ai for pi, ai in zip(p, a, strict=True)]
        step = weighted_sum([r.tensors["cum_update"] for r in replies.values()], coefs)
        self.global_params = self.server_opt.step(self.global_params, self.global_params - step)
        self.average_buffers(replies, p)
        return {"tau_eff": self.tau_eff}

    def round_metrics(self, rnd: int) -> dict[str, float]:
        return {"tau_eff": self.tau_eff}
