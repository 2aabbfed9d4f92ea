"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning"), option II.

The server holds a control variate c and each client its own c_i (zeros until the client first trains; absent from
the client's state means zeros). Every local step uses the corrected gradient g + c - c_i. After K local steps
(the client's real count: clients with more data take more steps, and each uses its own K) at the round's lr eta_l:

    c_i+ = c_i - c + (x - y_i) / (K eta_l)                      (option II)

and the client replies with delta_y = y_i - x and delta_c = c_i+ - c_i only. The server takes

    x <- x + eta_g * mean_i delta_y,    c <- c + (1/N) sum_i delta_c   (= c + |S|/N mean_i delta_c)

where N is the number of clients in the federation. The model step goes through the server optimiser with
target = x + mean_i delta_y, so ``server.lr`` is the global step size eta_g (1 by default, the paper's usual choice),
and FedAvgM / FedAdam compose with SCAFFOLD. Only the clients that replied count in |S|; a dropped client keeps its
old c_i, so c stays the mean of all N client variates.

Local momentum rho: the correction c - c_i is added to the gradient before the momentum step (as
Lee-Gihun/FedNTD does), so it is amplified like the gradient, and x - y_i is about 1/(1 - rho) times K eta_l times
the mean corrected gradient. Dividing by K eta_l then makes c_i+ about 1/(1 - rho) times too large, the next round
over-corrects by that factor, and training diverges (10x at rho = 0.9: Fashion-MNIST accuracy fell 72 -> 67 % from
round 1 to 2; 2x at rho = 0.5 in FedBC's Synthetic benchmark). So by default K is the momentum-effective step count
(FedNTD's ``adaptive_divison``), (K - rho (1 - rho^K) / (1 - rho)) / (1 - rho), the exact coefficient sum, and c_i+
is the mean corrected gradient again (Nesterov: its own exact count). With plain SGD it is K, i.e. option II
exactly; ``momentum_correction = false`` divides by K eta_l whatever the momentum.

Local optimiser: SGD only (``train.optimizer = "sgd"``), as the paper and its analysis; option II's estimate is a
mean gradient only for gradient steps of size eta_l, so Adam / AdamW are refused rather than run with a control
variate that is not one.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientContext, Message, Reply, weighted_sum
from fedhet.algorithms.fednova import effective_steps
from fedhet.algorithms.privacy import CentralDP


class ScaffoldConfig(AlgoConfig):
    # Karimireddy et al. 2020, Alg. 1: the server averages delta_y uniformly over the sampled clients; "samples"
    # weights it by client size as FedAvg does (the control variate update stays uniform either way).
    weighting: Literal["uniform", "samples"] = "uniform"
    # True: K is the momentum-effective step count (= K without momentum); False: K whatever the momentum, which
    # over-corrects by ~1/(1 - momentum) with local momentum (see the module docstring)
    momentum_correction: bool = True


@ALGORITHMS.register(
    "scaffold",
    "SCAFFOLD (Karimireddy et al. 2020): local steps corrected by control variates c - c_i, option II update",
    ScaffoldConfig,
)
class Scaffold(Algorithm):
    name = "scaffold"
    Config = ScaffoldConfig
    sgd_only = (
        "estimates each client's mean corrected gradient as (x - y_i) / (K lr) (option II), which holds for SGD "
        "steps (with momentum: its effective K) and not for Adam's per-coordinate normalised steps"
    )
    batchable = True  # default loss, hooks on the flat vectors only (engine/batched.py)
    central_dp = True  # its aggregate privatises the joint (delta_y, lr delta_c) itself (privatised_deltas)
    dp_sgd = True  # default loss; the control variates are computed from the privatised steps only

    # ----------------------------------------------------------------- server side
    def init_server(self, params: torch.Tensor, buffers: torch.Tensor) -> None:
        super().init_server(params, buffers)
        self.c = torch.zeros_like(self.global_params)

    def global_message(self, rnd: int) -> Message:
        msg = super().global_message(rnd)
        msg.tensors["c"] = self.c
        return msg

    def aggregation_weights(self, replies: dict[int, Reply]) -> list[float]:
        if self.config.weighting == "uniform":
            return [1.0 / len(replies)] * len(replies)
        return super().aggregation_weights(replies)

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        weights = self.aggregation_weights(replies)
        n = self.setup.num_clients
        if isinstance(self.privacy, CentralDP):
            target, self.c = self.private_target(rnd, replies)
        else:
            target = self.global_params + weighted_sum([r.tensors["delta_y"] for r in replies.values()], weights)
            # (1/N) sum over the replies keeps c equal to the mean of all N client variates (paper: |S|/N * mean).
            self.c = self.c + weighted_sum([r.tensors["delta_c"] for r in replies.values()], [1.0 / n] * len(replies))
        self.global_params = self.server_opt.step(self.global_params, target)
        self.average_buffers(replies, weights)
        return {}

    def aggregate_empty(self, rnd: int, phase: str) -> None:
        """Central DP with no reply: the joint vector's noise alone moves y and c (Algorithm.aggregate_empty)."""
        if isinstance(self.privacy, CentralDP):
            target, self.c = self.private_target(rnd, {})
            self.global_params = self.server_opt.step(self.global_params, target)

    def private_target(self, rnd: int, replies: dict[int, Reply]) -> tuple[torch.Tensor, torch.Tensor]:
        """Central DP: each client's joint vector (delta_y, s delta_c) clipped to C as one and noised as one, so the
        pair costs one release. delta_c is about -delta_y / (K eta_l) - c, so s = eta_l K_mean (the round's lr and
        the local steps of a mean-sized client, both public) puts it on delta_y's scale instead of letting it take
        the whole clip; c then gets noise z C / (N s) per coordinate a round, which moves a client's K steps by
        about z C / N, below the model's own z C / m. Returns the server's target x + (noised mean of delta_y) and
        the new c = c + (noised sum of delta_c) / N."""
        scale = self.round_lr(rnd) * self.privacy.mean_steps
        joint = [torch.cat([r.tensors["delta_y"], r.tensors["delta_c"] * scale]) for r in replies.values()]
        mean = self.privacy.mean(joint, like=None if joint else torch.cat([self.global_params, self.c]))
        p = self.global_params.numel()
        return self.global_params + mean[:p], self.c + mean[p:] * (
            self.privacy.per_round / scale
        ) / self.setup.num_clients

    def round_metrics(self, rnd: int) -> dict[str, float]:
        return {"c_norm": float(self.c.norm())}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "c": self.c}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.c = state["c"]

    # ----------------------------------------------------------------- client side
    def before_local(self, ctx: ClientContext) -> None:
        c = ctx.message.tensors["c"]
        c_i = ctx.state.get("c_i")
        ctx.scratch["correction"] = c.clone() if c_i is None else c - c_i

    def after_backward(self, ctx: ClientContext) -> None:
        ctx.flat.grad.add_(ctx.scratch["correction"])

    def divisor_steps(self, ctx: ClientContext) -> float:
        """K in option II's K * eta_l: the client's own step count, or its momentum-effective count."""
        t = ctx.train
        if self.config.momentum_correction:
            return effective_steps(ctx.steps, t.momentum, t.nesterov)
        return float(ctx.steps)

    def after_local(self, ctx: ClientContext) -> Reply:
        reply = super().after_local(ctx)
        delta_y = reply.tensors.pop("params").sub_(ctx.global_params)
        # delta_c = c_i+ - c_i = (x - y_i) / (K eta_l) - c, computed directly so c_i never cancels out in floats.
        delta_c = delta_y.div(-self.divisor_steps(ctx) * ctx.lr).sub_(ctx.message.tensors["c"])
        c_i = ctx.state.get("c_i")
        ctx.state["c_i"] = delta_c.clone() if c_i is None else c_i + delta_c
        reply.tensors["delta_y"] = delta_y
        reply.tensors["delta_c"] = delta_c
        return reply
