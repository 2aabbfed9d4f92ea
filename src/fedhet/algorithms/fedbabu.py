"""FedBABU (Oh, Kim and Yun, ICLR 2022, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", arXiv 2106.06042).

Federated training updates and aggregates only the body; the head (the last linear layer) is randomly initialised
and never updated. A client's round, with W_B the global body and W_H the fixed head:

    W_B,i <- local SGD epochs on CE(W_H f(x; W_B), y) with W_H frozen
    server: W_B <- sum_i n_i W_B,i / sum_i n_i,   W_H unchanged

The global model (G-FL, FedRANE's Table 1) is the averaged body with the initial head, the model the engine
evaluates. Personalisation (P-FL, Table 2) fine-tunes the global model on the client's own training data for
``finetune_epochs`` epochs and evaluates the result on its local test split.

Frozen head. The head gets no gradient, momentum or weight decay on clients: ``after_backward`` zeroes its gradient
before clipping (PFLlib's ``requires_grad = False``: no gradient at all) and ``after_step`` puts its values back
after every step, which undoes whatever the loop's weight decay and momentum did to it (the official code gives
the head lr 0 in a second parameter group, which has the same effect). The server keeps the head's slice bit for bit
(``algorithms/partial.py``), whatever the server optimiser. The head is the model's own ``head``, initialised as the
model builds it (PyTorch's default, as the official ``main_fed.py`` and PFLlib: the same for every client).

Fine-tuning runs the shared local loop once more (``ctx.phase == "personalize"``) from the global model, with
``train``'s batch size, momentum, weight decay, clipping and augmentation, for ``finetune_epochs`` epochs at
``finetune_lr`` (default: the round's training lr). What it trains: ``finetune = "full"`` the whole model, as the
official evaluation (``analysis.ipynb``: body and head in one SGD at the same lr, momentum 0.9) and PFLlib's
``fine_tune(which_module=['base', 'head'])`` do (the paper's abstract speaks of fine-tuning the head, its code
fine-tunes everything); ``"head"`` freezes the body the same way the head is frozen in training.

Defaults and references (official ``jhoon-oh/FedBABU``; ``TsingZ0/PFLlib`` clientbabu.py / serverbabu.py, the code
base of FedRANE's experiments):

* ``finetune_epochs = 5``: the official ``personalization_epoch = 5``; PFLlib's ``--fine_tuning_epochs`` default is 10.
* ``finetune_lr = None`` (the round's training lr): PFLlib fine-tunes with the client's training optimiser (plain
  SGD); the official notebook uses lr 1e-3 after training at 0.1 (set ``finetune_lr = 0.001`` for that). With
  momentum, the training lr is often too large here: under the frozen random head the body's features grow (norm ~100
  on Fashion-MNIST's CNN by round 3), the unfrozen head's gradient grows with them, and fine-tuning at lr 0.01 with
  momentum 0.9 overshoots and gets worse as training goes on (FedRANE's reproduction: P-FL 84 -> 32 % in rounds
  1-6). 0.001 with momentum 0.9 takes about PFLlib's plain-SGD step at 0.01.
* Aggregation weights by client samples (PFLlib); the official code averages uniformly (``weighting = "uniform"``).
* PFLlib fine-tunes once, after the last round; the official notebook fine-tunes the best model. Here every
  evaluation round fine-tunes a fresh copy of the current global model for each evaluated client (the engine's
  personalised protocol), so the curve of P-FL accuracy exists; nothing of it is kept.
* Normalisation statistics: the engine evaluates a personalised model with the global buffers, so BatchNorm running
  statistics updated during fine-tuning are not used (the official evaluation uses them).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Message, Setup
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.algorithms.partial import KeptSlice, top_layers

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer

FINETUNE = "personalize"  # the phase name of the engine's personalisation context: the hooks fine-tune there


class FedBABUConfig(FedAvgConfig):  # weighting "samples": PFLlib's aggregation (official code: uniform)
    # personalisation epochs on the client's training data: official analysis.ipynb personalization_epoch = 5
    # (PFLlib --fine_tuning_epochs default 10); 0 evaluates the global model itself
    finetune_epochs: int = Field(5, ge=0)
    # fine-tuning lr; None = the round's training lr (PFLlib's fine_tune uses the training optimiser; the official
    # notebook uses 1e-3 after training at 0.1)
    finetune_lr: float | None = Field(None, gt=0.0)
    # sensible defaults: PFLlib's 10 epochs and below; the notebook's 1e-3 to a usual training lr
    tunable: ClassVar[dict[str, str]] = {"finetune_epochs": "int:1:10", "finetune_lr": "log:1e-4:1e-1"}
    # "full": body and head (official analysis.ipynb, PFLlib fine_tune(['base', 'head'])); "head": head only (the
    # paper's abstract's wording)
    finetune: Literal["full", "head"] = "full"


@ALGORITHMS.register(
    "fedbabu",
    "FedBABU (Oh et al. 2022): body-only federated training under a frozen random head; personalised by fine-tuning",
    FedBABUConfig,
)
class FedBABU(KeptSlice, FedAvg):
    name = "fedbabu"
    head_refusal = (
        "freezes the head itself (the last layer that trains) and fine-tunes it to personalise, so the head must train"
    )
    Config = FedBABUConfig
    personalized = True
    batchable = True  # default loss, hooks on the flat vectors and the scratch only (engine/batched.py)

    def __init__(self, config: FedBABUConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self.kept, _ = top_layers(setup.build_model, 1, "algorithm")  # the head: frozen, and kept by the server
        self.body = slice(0, self.kept.start)

    def frozen(self, ctx: ClientContext) -> slice | None:
        """The slice this local loop must not move: the head in training; the body, or nothing, in fine-tuning."""
        if ctx.phase != FINETUNE:
            return self.kept
        return self.body if self.config.finetune == "head" else None

    # ----------------------------------------------------------------- server side: KeptSlice.aggregate

    # ----------------------------------------------------------------- client side
    def before_local(self, ctx: ClientContext) -> None:
        frozen = self.frozen(ctx)
        if frozen is not None:
            ctx.scratch["frozen"] = ctx.flat.params[frozen].clone()

    def after_backward(self, ctx: ClientContext) -> None:
        frozen = self.frozen(ctx)
        if frozen is not None:
            ctx.flat.grad[frozen] = 0.0  # no gradient, so none in the clipping norm either

    def after_step(self, ctx: ClientContext) -> None:
        frozen = self.frozen(ctx)
        if frozen is not None:
            ctx.flat.params[frozen] = ctx.scratch["frozen"]  # undoes weight decay and momentum on it

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        """The global model fine-tuned on this client's training data (never its test split)."""
        if self.config.finetune_epochs == 0:
            return ctx.global_params.clone()
        lr = self.config.finetune_lr or float(ctx.message.scalars.get("lr", ctx.train.lr))
        message = Message(tensors=ctx.message.tensors, scalars={**ctx.message.scalars, "lr": lr})
        train = ctx.train.model_copy(update={"local_epochs": self.config.finetune_epochs, "local_steps": None})
        finetune = dataclasses.replace(ctx, phase=FINETUNE, message=message, train=train, scratch={})
        return self.client_update(finetune).tensors["params"]
