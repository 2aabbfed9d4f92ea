"""FedRoD (Chen and Chao, ICLR 2022, "On Bridging Generic and Personalized Federated Learning for Image
Classification", arXiv 2107.00778).

The model is the shared body (features z), the generic head G (the model's own ``head``) and a personal head P that
``prepare_model`` attaches as ``personal_head``. On every mini-batch, one forward pass gives z and the G logits, and

    L_G = CE(G(z) + log n, y)                       balanced softmax (BSM), n = the client's local label counts
    L_P = CE(sg[G(z)] + P(sg[z]), y)                plain cross-entropy of the personalised logits

(sg = stop-gradient). L_G trains the body and G; L_P trains P only, on the detached features and on top of the
detached G logits. A class the client does not hold has n = 0, so its BSM logit is -inf: zero probability and no
gradient (log of raw counts, as PFLlib; FedNH uses proportions with 1e-12 for absent classes, a shift of -27.6,
which is the same up to ~1e-12 in probability; a constant log sum n cancels in the softmax). Both losses come from
the same forward pass, so P reads the features from before the body's step, and one backward of L_G + L_P gives
exactly the gradients of the references' two separate backward passes (they touch disjoint parameters).

The global model (aggregated, evaluated on the uniform test set, FedACD's Table 1) is body + G: ``FedModel.forward``
never reads ``personal_head``. ``personal_head = "linear"`` (Fed-RoD (linear)): P is a Linear layer of the G-head's
shape; each client keeps its own as client state (``ctx.state["personal_head"]``), loads it before training and
stores it after. It never leaves the client: the reply carries the received global values in P's slice, and the
server keeps the global P slice as it is (it is the initial P-head of every client: a copy of the initial G-head,
as PFLlib and FedNH ``deepcopy`` the head). Personalised model (FedRANE's P-FL protocol, PFLlib's evaluation): the
global body and G-head with the client's own P-head, G(z) + P(z) = (W_G + W_P) z + (b_G + b_P), returned by
``personalize`` as an ordinary model whose head is the sum.

``personal_head = "hyper"`` (Fed-RoD (hyper)): P's weight is generated from the client's label distribution by a
hypernetwork (Linear(C, D) -> ReLU -> Linear(D, D C), no bias on the generated head; FedNH's ``HyperClassifier``),
trained by L_P and aggregated with the body (FedNH keeps it in the model). There is no client state; a client's
personalised head is the global hypernetwork applied to its label distribution, so it exists even for a client
that never trained.

References. The official repository (``hongyouc/Fed-RoD``) holds only a README, so this follows the two
reimplementations that agree on the scheme above: ``TsingZ0/PFLlib`` ``system/flcore/clients/clientrod.py`` (linear
P-head, the code base of FedRANE's experiments) and ``Yutong-Dai/FedNH`` ``src/flbase/strategies/FedROD.py``
(hypernetwork by default, the baseline code FedACD's setup resembles). Differences, all deliberate:

* The P-head (or hypernetwork) takes plain SGD steps at the round's learning rate, as both references' separate
  ``torch.optim.SGD(lr)`` do, while the body and G-head use ``train``'s momentum, weight decay and clipping
  (``personal_optimizer = "shared"`` steps P with the loop's optimiser instead, as FL-bench's single optimiser).
* FedNH can train P only after all body epochs (``FedROD_phead_separate``); here P is trained on every batch
  (PFLlib, FedNH's default ``_train_together``).
* FedNH evaluates the personalised model with the client's local body and G-head after training; here, as in
  PFLlib, the client's P-head sits on the current global body and G-head (the engine's personalised protocol).
* FL-bench (``src/client/fedrod.py``) lets L_P reach the body and does not add G's logits; not followed.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Reply, Setup
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.algorithms.functional import aux_sums
from fedhet.algorithms.partial import step_keeping
from fedhet.toolkit.flat import FlatModel

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer
    from fedhet.models.base import FedModel

PERSONAL = "personal_head"  # the attribute prepare_model attaches; its parameters come last in the flat vector


class FedRoDConfig(FedAvgConfig):  # weighting "samples": PFLlib's aggregation (FedNH's code averages uniformly)
    # "linear": Fed-RoD (linear), a per-client P-head kept on the client (PFLlib clientrod.py, the code base of
    # FedRANE's P-FL numbers). "hyper": Fed-RoD (hyper), P generated from the label distribution by an aggregated
    # hypernetwork (FedNH's default FedROD_hyper_clf = True). The global model is the same either way.
    personal_head: Literal["linear", "hyper"] = "linear"
    # "plain": P takes plain SGD steps at the round's lr, without momentum, weight decay or clipping (its own
    # torch.optim.SGD(lr) in PFLlib and FedNH); "shared": P steps with the loop's optimiser (FL-bench).
    personal_optimizer: Literal["plain", "shared"] = "plain"


class HyperHead(nn.Module):
    """Label distribution (C,) -> the weight (C, D) of a bias-free personal head (FedNH's HyperClassifier)."""

    def __init__(self, embedding_dim: int, num_classes: int) -> None:
        super().__init__()
        self.shape = (embedding_dim, num_classes)
        self.inner = nn.Linear(num_classes, embedding_dim)
        self.outer = nn.Linear(embedding_dim, embedding_dim * num_classes)

    def forward(self, distribution: torch.Tensor) -> torch.Tensor:
        # FedNH reshapes to (D, C) and multiplies z @ H; the equivalent Linear weight is its transpose.
        return self.outer(F.relu(self.inner(distribution))).view(self.shape).t()


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, log_counts: torch.Tensor) -> torch.Tensor:
    """CE(logits + log n, y): Ren et al. 2020's balanced softmax, as Fed-RoD's generic loss."""
    return F.cross_entropy(logits + log_counts, y)


def label_distribution(counts: torch.Tensor) -> torch.Tensor:
    return counts / counts.sum()


@ALGORITHMS.register(
    "fedrod",
    "FedRoD (Chen & Chao 2022): balanced-softmax generic head (aggregated) + personal head on top (kept locally)",
    FedRoDConfig,
)
class FedRoD(FedAvg):
    name = "fedrod"
    head_refusal = (
        "splits the model at its head (a generic head and each client's personal one), so the head must train"
    )
    Config = FedRoDConfig
    # the label statistics are per-client inputs, P's own step runs on the flat vectors (algorithms/functional.py)
    batchable = True
    personalized = True
    weighted_aggregate = True  # aggregate's target is aggregate_target (server.aggregation = "gne" applies)

    def __init__(self, config: FedRoDConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self._slices: dict[str, slice] | None = None

    @classmethod
    def prepare_model(cls, config: FedRoDConfig, model: FedModel) -> FedModel:
        if config.personal_head == "linear":
            personal = copy.deepcopy(model.head)  # PFLlib/FedNH: the P-head starts as a copy of the initial G-head
        else:
            personal = HyperHead(model.embedding_dim, model.num_classes)
        setattr(model, PERSONAL, personal)
        return model

    @property
    def keeps_personal(self) -> bool:
        """True: P is client state, never aggregated (the linear variant)."""
        return self.config.personal_head == "linear"

    def slices(self) -> dict[str, slice]:
        """Where each parameter (and the whole personal module, under PERSONAL) lives in the flat vector."""
        if self._slices is None:
            with torch.random.fork_rng(devices=[]):  # building draws weights; the run's random stream must not move
                slices = FlatModel(self.setup.build_model()).slices()
            mine = [s for name, s in slices.items() if name.startswith(PERSONAL + ".")]
            slices[PERSONAL] = slice(mine[0].start, mine[-1].stop)  # one module: its parameters are contiguous
            self._slices = slices
        return self._slices

    # ----------------------------------------------------------------- server side
    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        weights = self.aggregation_weights(replies)
        target = self.aggregate_target(replies, weights)
        if self.keeps_personal:  # the P slice is every client's initial P-head: no server optimiser may move it
            self.global_params = step_keeping(self.server_opt, self.global_params, target, self.slices()[PERSONAL])
        else:
            self.global_params = self.server_opt.step(self.global_params, target)
        self.average_buffers(replies, weights)
        return {}

    # ----------------------------------------------------------------- client side
    def before_local(self, ctx: ClientContext) -> None:
        counts = ctx.data.label_counts()
        ctx.scratch["rod_inputs"] = {
            "log_counts": counts.log(),  # log 0 = -inf: an absent class gets no probability, no gradient
            "distribution": label_distribution(counts),
        }
        own = ctx.state.get(PERSONAL)
        if self.keeps_personal and own is not None:
            ctx.flat.params[self.slices()[PERSONAL]] = own

    def personal_logits(self, model: FedModel, z: torch.Tensor, distribution: torch.Tensor) -> torch.Tensor:
        personal = getattr(model, PERSONAL)
        if self.config.personal_head == "linear":
            return personal(z)
        return F.linear(z, personal(distribution))

    def loss_inputs(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        return ctx.scratch["rod_inputs"]

    def loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        z = model.body(x)
        generic = model.head(z)
        loss_g = balanced_softmax_loss(generic, y, inputs["log_counts"])
        personal = generic.detach() + self.personal_logits(model, z.detach(), inputs["distribution"])
        loss_p = F.cross_entropy(personal, y)
        return loss_g + loss_p, {"generic_loss": loss_g, "personal_loss": loss_p}

    def after_backward(self, ctx: ClientContext) -> None:
        if self.config.personal_optimizer == "plain":
            # Take P's gradient out of the loop's optimiser (and clipping); after_step puts P back and steps it.
            p = self.slices()[PERSONAL]
            ctx.scratch["personal_step"] = (ctx.flat.params[p].clone(), ctx.flat.grad[p].clone())
            ctx.flat.grad[p] = 0.0

    def after_step(self, ctx: ClientContext) -> None:
        if self.config.personal_optimizer == "plain":
            before, grad = ctx.scratch.pop("personal_step")
            ctx.flat.params[self.slices()[PERSONAL]] = before - ctx.lr * grad

    def after_local(self, ctx: ClientContext) -> Reply:
        if self.keeps_personal:
            p = self.slices()[PERSONAL]
            ctx.state[PERSONAL] = ctx.flat.params[p].clone()
            ctx.flat.params[p] = ctx.global_params[p]  # the P-head never leaves the client
        reply = super().after_local(ctx)
        steps = max(ctx.steps, 1)
        sums = aux_sums(ctx.scratch)
        reply.metrics.update(generic_loss=sums["generic_loss"] / steps, personal_loss=sums["personal_loss"] / steps)
        return reply

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        """The global body with G-head + this client's P-head folded into one head: logits G(z) + P(z)."""
        s = self.slices()
        params = ctx.global_params.clone()
        if self.keeps_personal:
            own = ctx.state.get(PERSONAL)
            if own is None:
                return None
            params[s[PERSONAL]] = own
            params[s["head.weight"]] += params[s[PERSONAL + ".weight"]]
            if "head.bias" in s:
                params[s["head.bias"]] += params[s[PERSONAL + ".bias"]]
            return params
        ctx.flat.set_params(params)  # the global hypernetwork generates this client's head
        with torch.no_grad():
            weight = getattr(ctx.model, PERSONAL)(label_distribution(ctx.data.label_counts()))
        params[s["head.weight"]] += weight.reshape(-1)
        return params
