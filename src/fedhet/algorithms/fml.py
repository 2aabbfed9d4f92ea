"""FML, Federated Mutual Learning (Shen, Zhang, Jia, Zhang et al. 2020, arXiv:2006.16765; FedUFO's baseline [22]).

Every client keeps a private model of its own across rounds and receives the global model as its "meme" model.
On every mini-batch both models see the same inputs and teach each other (deep mutual learning):

    L_private = alpha CE(p, y) + (1 - alpha) KL(softmax(sg[m]) || softmax(p))
    L_meme    = beta  CE(m, y) + (1 - beta)  KL(softmax(sg[p]) || softmax(m))

(p, m: the private and meme logits of the batch, sg = stop-gradient, KL averaged over the batch). Both losses come
from the same forward pass and both models step once per batch. Only the meme model is sent back and averaged
(weighted by samples, as FedAvg); the private model never leaves the client (``ctx.state["private"]``).

FedUFO reports FML's *global* model ("for fair comparison"), which is what the engine evaluates; the private models
are the personalised models (``personalize``), so ``personal_acc_*`` logs FML's own protocol beside it.

Sources. Shen et al. 2020 (Eq. 1-2, alpha = beta = 0.5 in their experiments) and their code
(ZJU-DAI/Federated-Mutual-Learning, ``src/Trainer.py`` ``train_mutual``: KLDivLoss(reduction="batchmean") of the
log-softmax against the other model's detached softmax, both losses backpropagated, then both optimisers step;
``Node.py``: the private model is built once per node with its own random initialisation and its optimiser lives
as long as the node, while the meme model and its optimiser are renewed from the global model every round).
Followed: the losses, the simultaneous steps, a private model with its own random initialisation
(``private_init = "random"``, seeded per client) and a private optimiser state (momentum buffer, or Adam's moments)
kept across rounds whatever ``train.optimizer_state`` says. Deviations: the private model has the global model's
architecture (FML allows another; fedhet's models are one per run); the private model steps with the run's ``train``
settings (optimiser, lr of the round, momentum, weight decay, Nesterov, clipping) where the official code hard-codes
weight decay 5e-4; ``private_init = "global"`` (a copy of the first global model
the client receives) is offered as a variant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Reply, Setup
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.toolkit.flat import FlatModel
from fedhet.toolkit.local import clip_grad_norm, local_optimizer

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer

PRIVATE = "private"
PRIVATE_OPT = "private_"  # the prefix of the private optimiser's state in the client's state
MOMENTUM = PRIVATE_OPT + "momentum"  # its SGD momentum buffer (Adam: private_exp_avg, _exp_avg_sq, _step)


class FMLConfig(FedAvgConfig):
    alpha: float = Field(0.5, ge=0.0, le=1.0)  # CE weight of the private model; Shen et al. 2020 experiments 0.5
    beta: float = Field(0.5, ge=0.0, le=1.0)  # CE weight of the meme model; Shen et al. 2020 experiments 0.5
    # sensible defaults: the CE weights over (0, 1); Shen et al. 2020 use 0.5 for both
    tunable: ClassVar[dict[str, str]] = {"alpha": "uniform:0.1:0.9", "beta": "uniform:0.1:0.9"}
    # "random": a private model of its own random initialisation (official Node.py), seeded from the client's first
    # round; "global": a copy of the first global model the client receives
    private_init: Literal["random", "global"] = "random"


def mutual_loss(own: torch.Tensor, other: torch.Tensor, y: torch.Tensor, ce_weight: float) -> torch.Tensor:
    """ce_weight CE(own, y) + (1 - ce_weight) KL(softmax(sg[other]) || softmax(own)), KL averaged over the batch."""
    kl = F.kl_div(F.log_softmax(own, dim=1), F.softmax(other.detach(), dim=1), reduction="batchmean")
    return ce_weight * F.cross_entropy(own, y) + (1 - ce_weight) * kl


@ALGORITHMS.register(
    "fml",
    "FML (Shen et al. 2020): private and meme (global) models trained by mutual distillation; meme averaged",
    FMLConfig,
)
class FML(FedAvg):
    name = "fml"
    Config = FMLConfig
    unbatchable_reason = "its loss trains a second (private) model with its own optimiser"
    personalized = True  # the private models

    def __init__(self, config: FMLConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self._private: tuple[torch.nn.Module, FlatModel] | None = None  # one per process, reloaded per client

    def private_model(self) -> tuple[torch.nn.Module, FlatModel]:
        if self._private is None:
            model = self.setup.build_model()
            self._private = (model, FlatModel(model))
        return self._private

    # ------------------------------------------------------------------------------------------------ client side
    def initial_private(self, ctx: ClientContext, flat: FlatModel) -> torch.Tensor:
        if self.config.private_init == "global":
            return ctx.global_params.clone()
        seed = int(torch.randint(2**62, (1,), generator=ctx.generator))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return FlatModel(self.setup.build_model()).get_params()

    def before_local(self, ctx: ClientContext) -> None:
        model, flat = self.private_model()
        if PRIVATE not in ctx.state:
            ctx.state[PRIVATE] = self.initial_private(ctx, flat)
        flat.set_params(ctx.state[PRIVATE])
        model.train()
        t = ctx.train
        opt = local_optimizer(flat, ctx.lr, t)
        opt.load(ctx.state, PRIVATE_OPT)  # kept across rounds, as the official node's optimiser
        ctx.scratch.update(private_opt=opt, private_loss=0.0)

    def local_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model, flat = self.private_model()
        meme_logits, private_logits = ctx.model(x), model(x)
        private_loss = mutual_loss(private_logits, meme_logits, y, self.config.alpha)
        flat.zero_grad()
        private_loss.backward()
        if ctx.train.grad_clip is not None:
            clip_grad_norm(flat.grad, ctx.train.grad_clip)
        ctx.scratch["private_opt"].step()
        ctx.scratch["private_loss"] += float(private_loss.detach())
        return mutual_loss(meme_logits, private_logits, y, self.config.beta)

    def after_local(self, ctx: ClientContext) -> Reply:
        _, flat = self.private_model()
        ctx.state[PRIVATE] = flat.get_params()
        ctx.scratch["private_opt"].save(ctx.state, PRIVATE_OPT)
        reply = super().after_local(ctx)
        reply.metrics["private_loss"] = ctx.scratch["private_loss"] / max(ctx.steps, 1)
        return reply

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        return ctx.state.get(PRIVATE)
