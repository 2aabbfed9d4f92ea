"""Per-FedAvg (Fallah, Mokhtari and Ozdaglar 2020, "Personalized Federated Learning with Theoretical Guarantees:
A Model-Agnostic Meta-Learning Approach").

Each local iteration at w, with three independent mini-batches D, D', D'' of the client's data:

    w~ = w - alpha grad f(w; D)                         (``inner_steps`` such steps, alpha = ``inner_lr``)
    g  = grad f(w~; D')
    first_order:   w <- w - beta g
    hessian_free:  w <- w - beta (g - alpha d),  d = [grad f(w + delta g; D'') - grad f(w - delta g; D'')] / (2 delta)

beta is the round's client lr (``train.lr``), so the step goes through the shared loop's optimiser: D' is the
loop's batch, and the inner and Hessian batches are drawn at random from the client's data with its generator (the
official FedBC code takes them from the same shuffled loader, so they never overlap within an epoch; here they may).
The server averages the models as FedAvg does (data-size weights, as the FedBC code's Per-FedAvg).

Personalised model: the global model after one SGD step of size alpha on one training mini-batch (Per-FedAvg's
evaluation). The FedBC code takes that step on a TEST batch; ``leaky = true`` reproduces this and logs the result
as ``personal_leaky_acc_*``.

``MamlMixin`` and ``finetune_one_step`` are shared with Per-FedBC (fedhet.algorithms.fedbc).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, ClientContext
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig


class MamlParams(AlgoConfig):
    inner_lr: float = Field(0.01, gt=0.0)  # alpha; official FedBC code --inner_lr default 0.01
    inner_steps: int = Field(1, ge=1)  # official FedBC code --K default 1; Per-FedAvg takes one step
    tunable: ClassVar[dict[str, str]] = {"inner_lr": "log:1e-3:1e-1"}  # sensible default: decades around 0.01
    # FO / HF are the two Per-FedAvg variants; the FedBC code implements first-order only.
    variant: Literal["first_order", "hessian_free"] = "first_order"
    delta: float = Field(1e-3, gt=0.0)  # HF finite-difference step; flgo's Per-FedAvg default 0.001
    # True: personalise with a step on the client's TEST split (FedBC code --eval_one_step); logged as leaky.
    leaky: bool = False


def sample_batch(ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A random mini-batch of ``train.batch_size`` samples (the whole set if smaller), augmented like training."""
    idx = torch.randperm(len(y), generator=ctx.generator)[: ctx.train.batch_size]
    xb = x[idx]
    if ctx.augment is not None:
        xb = ctx.augment(xb, ctx.generator)
    return xb, y[idx]


def finetune_one_step(ctx: ClientContext, start: torch.Tensor, lr: float, leaky: bool) -> torch.Tensor:
    """``start`` after one plain SGD step on one mini-batch of the client's training data (test data if leaky)."""
    ctx.flat.set_params(start)
    if "buffers" in ctx.message.tensors:
        ctx.flat.set_buffers(ctx.message.tensors["buffers"])
    ctx.model.train()
    if leaky:
        idx = torch.randperm(len(ctx.data.y_test), generator=ctx.generator)[: ctx.train.batch_size]
        xb, yb = ctx.data.x_test[idx], ctx.data.y_test[idx]
    else:
        xb, yb = sample_batch(ctx, ctx.data.x, ctx.data.y)
    ctx.flat.zero_grad()
    F.cross_entropy(ctx.model(xb), yb).backward()
    ctx.flat.params.sub_(ctx.flat.grad, alpha=lr)
    return ctx.flat.get_params()


class MamlMixin:
    """First-order / Hessian-free MAML local iterations through the shared loop's hooks.

    ``local_loss`` saves w, takes the inner steps in place and returns the loss at w~ on the loop's batch, so the
    loop's backward leaves g = grad f(w~; D') in the flat gradient; ``after_backward`` applies the Hessian-free
    correction if asked and restores w, and the loop's optimiser then steps w with g."""

    unbatchable_reason = "its loss takes MAML inner steps in place and draws extra batches (second-order step)"

    config: MamlParams
    personalized = True

    @property
    def personal_metric_prefix(self) -> str:
        return "personal_leaky" if self.config.leaky else "personal"

    def task_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """f(current params; x, y): the plain task loss the meta-steps differentiate."""
        return F.cross_entropy(ctx.model(x), y)

    def task_gradient(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> None:
        """Leave grad f(current params; x, y) in ``ctx.flat.grad``."""
        ctx.flat.zero_grad()
        self.task_loss(ctx, x, y).backward()

    def inner_extra_grad(self, ctx: ClientContext) -> None:
        """Extra gradient terms of the inner objective (Per-FedBC's proximal term); none for Per-FedAvg."""

    def local_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.scratch["maml_start"] = ctx.flat.get_params()
        for _ in range(self.config.inner_steps):
            self.task_gradient(ctx, *sample_batch(ctx, ctx.data.x, ctx.data.y))
            self.inner_extra_grad(ctx)
            ctx.flat.params.sub_(ctx.flat.grad, alpha=self.config.inner_lr)
        ctx.flat.zero_grad()
        return self.task_loss(ctx, x, y)

    def after_backward(self, ctx: ClientContext) -> None:
        start = ctx.scratch.pop("maml_start")
        if self.config.variant == "hessian_free":
            g = ctx.flat.grad.clone()
            hvp = self.hessian_vector(ctx, start, g)
            ctx.flat.grad.copy_(g - self.config.inner_lr * hvp)
        ctx.flat.set_params(start)

    def hessian_vector(self, ctx: ClientContext, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(grad f(w + delta v; D'') - grad f(w - delta v; D'')) / (2 delta) on a fresh batch D''."""
        xb, yb = sample_batch(ctx, ctx.data.x, ctx.data.y)
        d = self.config.delta
        grads = []
        for sign in (1.0, -1.0):
            ctx.flat.set_params(w + sign * d * v)
            self.task_gradient(ctx, xb, yb)
            grads.append(ctx.flat.grad.clone())
        return (grads[0] - grads[1]) / (2 * d)

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        return finetune_one_step(ctx, ctx.global_params, self.config.inner_lr, self.config.leaky)


class PerFedAvgConfig(FedAvgConfig, MamlParams):  # weighting "samples": the FedBC code's Per-FedAvg (FedAvg_sample)
    pass


@ALGORITHMS.register(
    "perfedavg",
    "Per-FedAvg (Fallah et al. 2020): MAML local steps (first-order or Hessian-free); personalised by one step",
    PerFedAvgConfig,
)
class PerFedAvg(MamlMixin, FedAvg):
    name = "perfedavg"
    Config = PerFedAvgConfig
