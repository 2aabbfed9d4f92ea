"""APPLE (Luo and Wu, IJCAI 2022, "Adapt to Adaptation: Learning Personalization for Cross-Silo Federated
Learning", arXiv 2110.08394).

Every client i owns a *core model* c_i and a *directed relationship* (DR) vector p_i in R^N (N clients). Its
personalised model is the p_i-weighted combination of all clients' core models,

    w_i = sum_j p_ij c_j,

and on each mini-batch it minimises, over its own core c_i and over p_i (the other cores are fixed in the round),

    L(w_i; x, y) + lambda(r) mu ||p_i - p_0||^2,

so that, with g = grad_w L at w_i,

    grad c_i  = p_ii g
    grad p_ij = <g, c_j> + 2 lambda(r) mu (p_ij - p_0j)      (c_i for j = i: the client's current core)

The proximal weight decays over the first ``decay_rounds`` rounds r = 0, 1, ... (round - 1) and is 0 afterwards:
lambda(r) = 0.001^(r / R) ("exponential", the official default) or (cos(pi r / R) + 1) / 2 ("cosine"). While it is
large, p_i stays near the prior p_0 (a FedAvg-like mixture, the global objective); as it vanishes, p_i is free to
learn how much client i should take from each other client.

Server: it holds the latest core of every client (an N x P tensor). Each round it sends a sampled client its own
core as ``params`` (what the shared loop loads and trains) and the stack of all cores as ``cores``; in the
simulation that tensor is one object shared by every message, read-only, so a round costs one N x P copy on the
server (when the replies come back), not one per client. The reply is the client's updated core, which replaces its
row. p_i never leaves the client: it is client state (``ctx.state["apple_p"]``).

Within fedhet's loop: the flat vector holds the client's core c_i, which the loop's optimiser steps. ``local_loss``
writes w_i into the flat vector for the forward/backward pass; ``after_backward`` reads g, computes p_i's gradient,
puts c_i back and scales the gradient to p_ii g, so the loop's SGD (momentum, weight decay, clipping of
``train``) steps the core. p_i takes its own momentum SGD step (``dr_lr``, ``dr_momentum``), with both updates
computed from the same forward pass, as the official single optimiser over both parameter groups does.

Global model (G-FL): APPLE has none; FedRANE reports it for P-FL only (its category 2). ``global_params``, what the
engine evaluates on the global test set, is the sample-weighted mean of the cores the server holds (the clients'
sizes are known once they have replied), stepped through the server optimiser (plain averaging by default). It is
the personalised model of a client whose p is the sample-fraction vector, i.e. the model the prior of the official
code pulls towards; it is reported for completeness and is not APPLE's output. Personalised model (P-FL):
``personalize`` returns sum_j p_ij c_j with the client's p_i and the cores as the server holds them after the round.

References. Official code ``ljaiverson/pFL-APPLE`` (``train_APPLE.py``, ``utils/apple.py``, ``utils/losses.py``,
``utils/models.py``): followed for the gradients (its ``ClientNet`` evaluates sum_j p_j layer_j(x), whose gradient
with respect to p_j is exactly <g, c_j> for linear and convolutional layers), the unhalved proximal term, the
decay schedules and their defaults (mu = 0.1, exponential, over the first 10% of the rounds), lr_coef = 0.001 with
momentum 0.9 for p. ``TsingZ0/PFLlib`` (``clientapple.py``, ``serverapple.py``; FedRANE's code base) uses the
per-tensor *mean* of g * c_j averaged over tensors as p's gradient, no momentum, a cosine lambda over all rounds,
and uploads the combined model rather than the core; not followed, since it departs from the paper's gradient.
One PFLlib choice is the default here: every core starts from the same initial model (``core_init = "shared"``;
officially one independently initialised ``Net`` per client). With N = 20 clients and p near 1/N, the mixture of
20 independently initialised networks is close to the zero network and barely trains in a short run; from one
shared start the personalised models begin as the initial model. PFLlib's other choice, a core step N times the
learning rate (``scale_core_lr``; the paper's update with eta = N * train.lr, the gradient scaled before clipping,
weight decay not), only reparametrises the learning rate and is off (official). Measured on Fashion-MNIST (20% of
the training set), 20 clients, Dirichlet 0.5, the MLP, batch 128, one local epoch, 10 rounds; global / personalised
accuracy after round 10 (FedAvg at lr 0.05: 71% global): independent cores, lr 0.05: 10% / 10%; independent,
lr 1.0: 20% / 36%; shared, lr 0.05: 30% / 30%; shared, scaled, lr 0.05: 45% / 52%; shared, lr 0.5: 65% / 72%. So
APPLE needs its own learning rate (FedRANE tunes every method). The last two runs' training loss jumped mid-run
(0.98 -> 1.92, 0.95 -> 1.68) while the proximal weight decays; p is unconstrained, as officially, and the
clients' sum_j p_ij had drifted to 1.1-1.4 by round 10.
Differences from the official code, all deliberate:

* Prior p_0 = uniform 1/N by default (the official code uses the clients' sample fractions for both p_0 and the
  initial p, which needs every client's size before the first round; fedhet's server learns the sizes only from
  replies). With equal-sized clients the two are the same.
* The core optimiser is ``train``'s (lr, momentum, weight decay, clipping); the official one is SGD with momentum
  0.9 at ``lr_net`` = 0.01. Both learning rates decay by ``train.lr_decay`` per round, as the official ``decay``.
* ``decay_rounds`` is a number of rounds (16 = 10% of the official 160) because an algorithm is not told
  ``run.rounds``.
* Bandwidth-limited downloading (``limit_downloaded_models``, off by default officially) is not implemented: every
  client receives all cores.
* A model with normalisation buffers combines parameters only (buffers are averaged as in FedAvg); the official
  ``ClientNet`` has none.
* The personalised model is evaluated with the other clients' cores as uploaded in the same round (officially,
  as they were at the round's start, when the client downloaded them).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Message, Reply, Setup, weighted_sum
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.toolkit.flat import FlatModel

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer

STATE_P = "apple_p"  # the client's DR vector p_i (client state)


class APPLEConfig(FedAvgConfig):
    mu: float = Field(0.1, ge=0.0)  # proximal weight on ||p - p0||^2: official --mu 0.1
    # lambda(r)'s shape: official --scheduler default "exponential" (0.001^(r/R)); "cosine" = (cos(pi r/R) + 1)/2
    scheduler: Literal["exponential", "cosine"] = "exponential"
    # R: rounds over which lambda decays, 0 afterwards; official 10% of the rounds (0.1 x 160 = 16)
    decay_rounds: int = Field(16, ge=1)
    dr_lr: float = Field(0.001, gt=0.0)  # learning rate of p: official --lr_coef 0.001
    dr_momentum: float = Field(0.9, ge=0.0, lt=1.0)  # p's SGD momentum: official optimiser momentum 0.9
    # sensible defaults: decades around the official mu = 0.1 and lr_coef = 0.001
    tunable: ClassVar[dict[str, str]] = {"mu": "log:1e-2:1", "dr_lr": "log:1e-4:1e-2"}
    # "shared": every core starts from the global initial model (PFLlib, FedRANE's code base: deepcopies of the
    # global model); "independent": each from its own random initialisation (official: one Net per client). See the
    # module docstring for why "shared" is the default.
    core_init: Literal["shared", "independent"] = "shared"
    # True: the core takes steps of N * train.lr (PFLlib clientapple.py multiplies the learning rate by the number of
    # clients: the paper's update with eta = N * train.lr); False: eta = train.lr (official code). See the module
    # docstring for why False is the default.
    scale_core_lr: bool = False


def proximal_weight(cfg: APPLEConfig, rnd: int) -> float:
    """lambda(r) mu for round ``rnd`` (1-based; the official r is 0-based)."""
    r = rnd - 1
    if cfg.mu == 0 or r >= cfg.decay_rounds:
        return 0.0
    if cfg.scheduler == "cosine":
        return (math.cos(math.pi * r / cfg.decay_rounds) + 1) / 2 * cfg.mu
    return 0.001 ** (r / cfg.decay_rounds) * cfg.mu


def combine(cores: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """sum_j p_j cores_j."""
    return torch.mv(cores.t(), p)


@ALGORITHMS.register(
    "apple",
    "APPLE (Luo & Wu 2022): personalised model = learned mixture sum_j p_ij c_j of all clients' core models",
    APPLEConfig,
)
class APPLE(FedAvg):
    name = "apple"
    Config = APPLEConfig
    unbatchable_reason = (
        "its loss loads the personalised mix of all cores into the model and after_backward steps the mixing weights"
    )
    personalized = True

    def __init__(self, config: APPLEConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self.cores: torch.Tensor | None = None  # (N, P): the latest core model of every client
        self.sizes: torch.Tensor | None = None  # (N,): each client's sample count, 0 until it has replied

    # ----------------------------------------------------------------- server side
    def init_server(self, params: torch.Tensor, buffers: torch.Tensor) -> None:
        super().init_server(params, buffers)
        n = self.setup.num_clients
        if self.config.core_init == "shared":
            self.cores = params.expand(n, -1).clone()
        else:
            self.cores = torch.stack([self.initial_core(j) for j in range(n)]).to(params.device)
        self.sizes = torch.zeros(n, dtype=torch.float64)

    def initial_core(self, cid: int) -> torch.Tensor:
        """A fresh initialisation for client ``cid``, seeded from the run-seeded global generator without
        advancing it (so the run's other random streams do not depend on the number of clients)."""
        with torch.random.fork_rng(devices=[]):
            base = int(torch.randint(0, 2**62, (1,)))
            torch.manual_seed(base + cid)
            return FlatModel(self.setup.build_model()).get_params()

    def round_scalars(self, rnd: int) -> dict[str, float]:
        decay = self.setup.train.lr_decay ** (rnd - 1)
        return {"apple_dr_lr": self.config.dr_lr * decay, "apple_reg": proximal_weight(self.config, rnd)}

    def configure(self, rnd: int, cids: list[int], phase: str) -> dict[int, Message]:
        shared = self.global_message(rnd)
        out = {}
        for cid in cids:
            # the client's own core is a row view of the shared stack: nothing is copied per client
            out[cid] = Message(tensors={**shared.tensors, "params": self.cores[cid]}, scalars=dict(shared.scalars))
        return out

    def global_message(self, rnd: int) -> Message:
        msg = super().global_message(rnd)
        msg.tensors["cores"] = self.cores
        msg.scalars.update(self.round_scalars(rnd))
        return msg

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        cores = self.cores.clone()  # the old stack may still be referenced by this round's messages
        for cid, reply in replies.items():
            cores[cid] = reply.tensors["params"]
            self.sizes[cid] = float(reply.num_examples)
        self.cores = cores
        held = [cid for cid in range(len(cores)) if self.sizes[cid] > 0]
        total = float(self.sizes[held].sum())
        target = weighted_sum([cores[cid] for cid in held], [float(self.sizes[cid]) / total for cid in held])
        self.global_params = self.server_opt.step(self.global_params, target)
        self.average_buffers(replies, self.aggregation_weights(replies))
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "cores": self.cores, "sizes": self.sizes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.cores = state["cores"]
        self.sizes = state["sizes"]

    # ----------------------------------------------------------------- client side
    def prior(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.full((n,), 1.0 / n, dtype=like.dtype, device=like.device)

    def before_local(self, ctx: ClientContext) -> None:
        cores = ctx.message.tensors["cores"]
        p = ctx.state.get(STATE_P)
        ctx.scratch["apple"] = {
            "p": self.prior(len(cores), cores).clone() if p is None else p.clone(),
            "buf": None,  # p's momentum buffer: fresh every round, as the official per-round optimiser
            "core": None,
        }

    def local_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s, cores = ctx.scratch["apple"], ctx.message.tensors["cores"]
        own = ctx.flat.params.detach().clone()
        s["core"] = own
        p, i = s["p"], ctx.cid
        personal = combine(cores, p).add_(own - cores[i], alpha=float(p[i]))  # row i is the client's current core
        with torch.no_grad():
            ctx.flat.params.copy_(personal)  # forward and backward at w_i; after_backward puts c_i back
        return F.cross_entropy(ctx.model(x), y)

    def after_backward(self, ctx: ClientContext) -> None:
        s, cores, scalars = ctx.scratch["apple"], ctx.message.tensors["cores"], ctx.message.scalars
        p, own, i = s["p"], s["core"], ctx.cid
        g = ctx.flat.grad
        grad_p = torch.mv(cores, g)
        grad_p[i] = torch.dot(own, g)
        grad_p.add_(p - self.prior(len(p), p), alpha=2 * float(scalars["apple_reg"]))
        with torch.no_grad():
            ctx.flat.params.copy_(own)
        scale = len(p) if self.config.scale_core_lr else 1
        g.mul_(float(p[i]) * scale)  # grad c_i = p_ii g, stepped by the loop's optimiser
        buf = s["buf"]
        s["buf"] = grad_p.clone() if buf is None else buf.mul_(self.config.dr_momentum).add_(grad_p)
        p.sub_(s["buf"], alpha=float(scalars["apple_dr_lr"]))

    def after_local(self, ctx: ClientContext) -> Reply:
        p = ctx.scratch["apple"]["p"]
        ctx.state[STATE_P] = p.clone()
        reply = super().after_local(ctx)
        reply.metrics["apple_p_self"] = float(p[ctx.cid])
        return reply

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        p = ctx.state.get(STATE_P)
        if p is None:
            return None
        return combine(ctx.message.tensors["cores"], p)
