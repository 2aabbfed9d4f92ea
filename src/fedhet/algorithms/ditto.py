"""Ditto (Li, Hu, Beirami and Smith, ICML 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization").

Two models per client. The global model w is trained as by FedAvg: the client runs the shared loop from the
received w^t (with ``train``'s optimiser, momentum, clipping) and replies with w_k^t, which the server averages.
The personal model v_k lives in the client's state and solves

    min_v  h_k(v; w^t) = F_k(v) + lam/2 ||v - w^t||^2

by ``personal_steps`` plain SGD iterations on mini-batches of the client's training data,

    v_k <- v_k - eta_p (grad F_k(v_k; batch) + lam (v_k - w^t))

always pulled toward the *received* global model w^t (not toward w_k^t). Order (Algorithm 1 of the paper): the
global update first, then the personal iterations; both start from what the client held at the start of the round,
so the order changes only which mini-batches each draws from the client's generator, not the mathematics.

P-FL evaluation (``personalize``) is v_k; the engine's global model (G-FL) is the FedAvg model w.

References and differences:

* Paper, Algorithm 1: global update then s personal iterations, one learning rate eta for both (``personal_lr``
  unset = the round's lr). Followed.
* Official code (``litian96/ditto``, ``flearn/trainers_MTL/ditto.py``): interleaves the two on the same batch, one
  personal step then one global step, ``local_iters`` of each, so the personal model takes as many steps as the
  global one: ``personal_epochs`` unset does the same number of steps (on batches of its own); its Fashion-MNIST
  scripts use lam = 1 (the default here). Its ``dynamic_lam`` (lam picked per step on validation data) is not
  implemented.
* PFLlib (``clientditto.py``/``serverditto.py``, the code base of FedRANE's Table 2): ``ptrain`` (the personal
  model, ``plocal_steps`` = 1 epoch by default) runs *before* ``train`` (the global model, 5 epochs); its
  ``PerturbedGradientDescent`` is the same plain proximal step. ``personal_epochs = 1`` reproduces its step count.
  Its ``mu`` (= lam) defaults to 0, which would make the personal model a purely local one.
* v_k starts from w^0 in the paper and both codes; here a client's v_k starts from the global model it receives the
  first time it trains (the same under full participation, FedRANE's protocol; the client does not hold w^0).
* Normalisation buffers (BatchNorm): the personal model uses the running statistics of the model it is loaded into
  and the engine evaluates every personalised model with the global statistics, so v_k has no statistics of its own
  (PFLlib keeps them in ``pmodel``); the reply's buffers are those of the global update.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Reply
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.toolkit.local import batch_indices, num_local_steps

PERSONAL = "personal"  # the client-state key of v_k


# weighting "samples": PFLlib's aggregation (the official code samples clients in proportion to their data and then
# averages uniformly, the same in expectation)
class DittoConfig(FedAvgConfig):
    # lam in h_k = F_k(v) + lam/2 ||v - w||^2. Official code run_fashion_*_ditto_lam1.sh: lam = 1 (its dynamic_lam
    # picks from {0.1, 1, 2}); PFLlib's -mu default 0 means no pull at all.
    lam: float = Field(1.0, ge=0.0)
    # Li et al. 2021 (Ditto): lam from {0.05, 0.1, 0.2, 0.5, 1, 2}; the official dynamic_lam picks from {0.1, 1, 2}
    tunable: ClassVar[dict[str, str]] = {"lam": "log:0.05:2"}
    # Step size of the personal SGD; unset = the round's lr (paper's single eta, official code, PFLlib).
    personal_lr: float | None = Field(None, gt=0.0)
    # Personal iterations per round as passes over the client's data; unset = as many steps as the global update
    # took (official code: one personal step per global step); 1 = PFLlib's plocal_steps default.
    personal_epochs: float | None = Field(None, gt=0.0)


@ALGORITHMS.register(
    "ditto",
    "Ditto (Li et al. 2021): FedAvg global model + personal models v_k with lam/2 ||v_k - w||^2, kept on clients",
    DittoConfig,
)
class Ditto(FedAvg):
    name = "ditto"
    Config = DittoConfig
    unbatchable_reason = "after_local trains a second, personal model in its own loop"
    personalized = True

    # ----------------------------------------------------------------- client side
    def after_local(self, ctx: ClientContext) -> Reply:
        local = ctx.flat.get_params()  # w_k^t, the global update's result
        buffers = ctx.flat.get_buffers()
        ctx.state[PERSONAL] = self.train_personal(ctx)
        ctx.flat.set_params(local)
        ctx.flat.set_buffers(buffers)
        reply = super().after_local(ctx)
        reply.metrics["personal_loss"] = ctx.scratch["personal_loss"]
        return reply

    def personal_step_count(self, ctx: ClientContext) -> int:
        epochs = self.config.personal_epochs
        if epochs is None:
            return max(ctx.steps, 1)
        return num_local_steps(len(ctx.data), ctx.train.batch_size, epochs, None)

    def train_personal(self, ctx: ClientContext) -> torch.Tensor:
        """v_k after the round's personal iterations, proximal to the received global model."""
        c = self.config
        lr = ctx.lr if c.personal_lr is None else c.personal_lr
        anchor = ctx.global_params
        ctx.flat.set_params(ctx.state.get(PERSONAL, anchor))
        total, steps = 0.0, self.personal_step_count(ctx)
        for idx in batch_indices(len(ctx.data), ctx.train.batch_size, steps, ctx.generator, ctx.data.x.device):
            x, y = ctx.data.x[idx], ctx.data.y[idx]
            if ctx.augment is not None:
                x = ctx.augment(x, ctx.generator)
            ctx.flat.zero_grad()
            loss = self.personal_loss(ctx, x, y)
            loss.backward()
            v = ctx.flat.params
            v.sub_(ctx.flat.grad.add(v - anchor, alpha=c.lam), alpha=lr)
            total += float(loss.detach())
        ctx.scratch["personal_loss"] = total / steps
        return ctx.flat.get_params()

    def personal_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """F_k(v; batch): the plain task loss of the personal model (the proximal term is added to its gradient)."""
        return F.cross_entropy(ctx.model(x), y)

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        return ctx.state.get(PERSONAL)
