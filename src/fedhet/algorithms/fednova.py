"""FedNova (Wang et al. 2020, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated Optimization").

Clients run plain local SGD (with the run's momentum / Nesterov / weight decay and, optionally, FedProx's proximal
term) for however many steps their data gives them, and reply with their cumulative update d_i = x - y_i and its
normaliser a_i (the sum of the coefficients with which the local gradients enter d_i / lr). The server removes the
bias towards clients that took more steps by averaging the normalised updates d_i / a_i:

    p_i = n_i / sum_j n_j,   tau_eff = sum_i p_i a_i,   x <- x - tau_eff * sum_i p_i d_i / a_i.

The step goes through the server optimiser (target = the right-hand side above), so ``server.lr`` scales it and
FedAvgM reproduces the official code's global momentum ``gmf``.

Reading of the official code (JYWa/FedNova, distoptim/FedNova.py): the proximal term is added to the step after
momentum, so it never enters the momentum buffer; we do the same. With momentum rho and prox (eta * mu != 0) together,
the official step runs ``vec += counter`` and then ``vec = vec * (1 - eta mu) + 1``, which counts each step twice;
the coefficient sum of the dynamics it actually runs is ``vec = vec * (1 - eta mu) + counter``, which we use (it
reduces to the official value when either rho or mu is zero). With Nesterov momentum the official code keeps the
heavy-ball normaliser; we use the exact one (each step's direction is g + rho * buf, so it adds 1 + rho * counter).
Weight decay counts as part of the gradient, as in the official code. The official code sets tau_eff from the raw
step counts when mu != 0; we keep tau_eff = sum_i p_i a_i as in the paper.
"""

from __future__ import annotations

import math

from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientContext, Reply, weighted_sum


class FedNovaConfig(AlgoConfig):
    # JYWa/FedNova: FedNova(mu=0) is plain FedNova; mu > 0 adds FedProx's proximal term (the paper's FedProx+FedNova)
    mu: float = Field(0.0, ge=0.0)


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
    """FedNova's a_i for ``steps`` local steps; ``eta_mu`` = lr * mu of the proximal term (applied after momentum)."""
    if not eta_mu:
        return effective_steps(steps, momentum, nesterov)
    counter = vec = 0.0
    for _ in range(steps):  # JYWa/FedNova's per-step recursion (see the module docstring for the momentum case)
        counter = counter * momentum + 1
        vec = vec * (1 - eta_mu) + (1 + momentum * counter if nesterov else counter)
    return vec


@ALGORITHMS.register(
    "fednova",
    "FedNova (Wang et al. 2020): average of step-normalised client updates, rescaled by tau_eff",
    FedNovaConfig,
)
class FedNova(Algorithm):
    name = "fednova"
    Config = FedNovaConfig
    batchable = True  # default loss, hooks on the flat vectors only (engine/batched.py)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tau_eff = math.nan

    # ----------------------------------------------------------------- client side
    def after_backward(self, ctx: ClientContext) -> None:
        if self.config.mu:
            # Applied after the optimiser step (in after_step), outside the momentum buffer, as in JYWa/FedNova.
            ctx.scratch["prox"] = (ctx.flat.params - ctx.global_params).mul_(self.config.mu)

    def after_step(self, ctx: ClientContext) -> None:
        if self.config.mu:
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
