"""FedBC (Bedi, Fan, Koppel, Sahu, Sadler, Huang, Manocha, "FedBC: Federated Learning Beyond Consensus").

FedBC replaces the consensus constraint x_i = z by a proximity constraint ||x_i - z||^2 <= gamma_i and runs a
stochastic primal-dual method on its Lagrangian (notes/fedbc.md section 2):

* client i (lambda_i, gamma_i received as scalars): local SGD on  f_i(x) + lambda_i (||x - z||^2 - gamma_i),  whose
  extra gradient 2 lambda_i (x - z) is added exactly on the flat vectors (no 1/2: lambda = mu/2 is FedProx's mu);
  it starts from z (official code) or, with ``warm_start``, from its previous local model (paper Alg. 2). It replies
  with its model and one scalar, ``sq_dist`` = ||x_i - z||^2;
* server, per replied client, before aggregating (Eq. 11; gamma heuristic of "Selection of gamma_i"):
      lambda_i <- clip(lambda_i + alpha (||x_i - z||^2 - gamma_i), lambda_min, lambda_max)
      gamma_i  <- gamma_i + eta_gamma lambda_i        (learned gamma; lambda before this round's step, as the
                                                       official code's joint optimiser step takes it)
  then z <- sum_j lambda_j x_j / sum_j lambda_j over the replied clients with the NEW lambdas (Eq. 13). If they all
  are zero (Eq. 13 is 0/0) the server averages uniformly instead and counts it in ``uniform_fallbacks``.

lambda_i and gamma_i are server-held per-client state (in ``state_dict``). ``dual_momentum`` > 0 reproduces the
official code's SGD(momentum=0.5) dual optimiser, but with one buffer per client: the official single buffer over
the whole lambda vector keeps moving clients that are not being updated (notes/fedbc.md A5).

Personalised evaluation: FedBC's personalised model is the client's last local model x_i (kept as client state).
``fedbc_finetune`` adds one plain SGD step on a training mini-batch before evaluation; the paper's FedBC-FineTune
takes that step on the client's TEST data, which is only available behind ``leaky = true`` and is then logged as
``personal_leaky_acc_*``. ``per_fedbc`` trains with first-order MAML steps (fedhet.algorithms.perfedavg) and
personalises the global model with one step, as the official ``--train_MAML --test_MAML --eval_one_step``.

Server-side diagnostics for Fig. 3-4: lambda/gamma means, and for the smallest and largest client seen so far the
aggregation-weight share lambda_i / sum_all lambda and the data share n_i / sum_known n (sizes are learnt from the
replies' ``num_examples``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field, model_validator

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientContext, Message, Reply, Setup
from fedhet.algorithms.perfedavg import MamlMixin, MamlParams, finetune_one_step

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer


class FedBCConfig(AlgoConfig):
    # alpha: official synthetic_jobs.sh --lamb_lr 1e-3 (logistic regression); the CIFAR example uses 5e-4. The paper
    # leaves it to the missing App. E. ||x - z||^2 sums over all parameters, so the scale is model-specific.
    dual_lr: float = Field(1e-3, ge=0.0)
    # official lamb_lr: 1e-3 (synthetic), 5e-4 (CIFAR) (notes/fedbc.md); a decade either side
    tunable: ClassVar[dict[str, str]] = {"dual_lr": "log:1e-4:1e-2"}
    # eta_gamma; None = dual_lr, as the official code steps lambda and gamma with one optimiser and one lr.
    gamma_lr: float | None = Field(None, ge=0.0)
    # Paper "Selection of gamma_i": gamma starts at 0 and is learned; official default (no --fix_gamma) too.
    learn_gamma: bool = True
    gamma: float = Field(0.0, ge=0.0)  # initial (or, with learn_gamma = false, fixed) gamma; official --gamma 0
    lambda_init: float = Field(0.0, ge=0.0)  # official code: torch.zeros(num_users)
    lambda_min: float = Field(0.0, ge=0.0)  # official code clamp_(min=0); paper's lambda_min is in the missing appendix
    lambda_max: float | None = Field(None, gt=0.0)  # paper's Lambda = [lambda_min, lambda_max]; official: none
    # 0: the paper's plain projected step (Eq. 11). 0.5: official --lamb_momentum, with one buffer per client.
    dual_momentum: float = Field(0.0, ge=0.0, lt=1.0)
    # False: start local training from z^t (official code); True: from the client's x_i^t (paper Alg. 2).
    warm_start: bool = False

    @model_validator(mode="after")
    def _bounds(self) -> FedBCConfig:
        if self.lambda_max is not None and self.lambda_max < self.lambda_min:
            raise ValueError(f"lambda_max={self.lambda_max} is below lambda_min={self.lambda_min}")
        return self


@ALGORITHMS.register(
    "fedbc",
    "FedBC (Bedi et al.): per-client duals lambda_i, learned tolerance gamma_i, lambda-weighted aggregation",
    FedBCConfig,
)
class FedBC(Algorithm):
    name = "fedbc"
    Config = FedBCConfig
    batchable = True  # default loss, hooks on the flat vectors only (engine/batched.py)
    personalized = True

    def __init__(self, config: FedBCConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        n = setup.num_clients
        self.lam = torch.full((n,), config.lambda_init, dtype=torch.float64)
        self.gamma = torch.full((n,), config.gamma, dtype=torch.float64)
        self.lam_buf = torch.zeros(n, dtype=torch.float64)  # per-client dual momentum buffers
        self.gamma_buf = torch.zeros(n, dtype=torch.float64)
        self.dual_steps = torch.zeros(n, dtype=torch.int64)
        self.sizes = torch.zeros(n, dtype=torch.int64)  # learnt from replies; 0 = not seen yet
        self.uniform_fallbacks = 0

    @property
    def personal_metric_prefix(self) -> str:
        return "personal_leaky" if getattr(self.config, "leaky", False) else "personal"

    # ----------------------------------------------------------------- server side
    def configure(self, rnd: int, cids: list[int], phase: str) -> dict[int, Message]:
        base = self.global_message(rnd)
        return {
            cid: Message(
                tensors=base.tensors,
                scalars={**base.scalars, "lambda": float(self.lam[cid]), "gamma": float(self.gamma[cid])},
            )
            for cid in cids
        }

    def update_dual(self, cid: int, sq_dist: float) -> None:
        """Eq. 11 for lambda_i and the gamma heuristic, one simultaneous (optionally momentum) step."""
        c = self.config
        step_lam = sq_dist - float(self.gamma[cid])  # ascent direction for lambda
        step_gamma = float(self.lam[cid])  # descent on L in gamma: dL/dgamma = -lambda
        if c.dual_momentum:
            first = int(self.dual_steps[cid]) == 0  # torch.optim.SGD: the first buffer is the gradient itself
            self.lam_buf[cid] = step_lam if first else c.dual_momentum * self.lam_buf[cid] + step_lam
            self.gamma_buf[cid] = step_gamma if first else c.dual_momentum * self.gamma_buf[cid] + step_gamma
            step_lam, step_gamma = float(self.lam_buf[cid]), float(self.gamma_buf[cid])
        self.dual_steps[cid] += 1
        lam = max(c.lambda_min, float(self.lam[cid]) + c.dual_lr * step_lam)
        self.lam[cid] = lam if c.lambda_max is None else min(lam, c.lambda_max)
        if c.learn_gamma:
            self.gamma[cid] += (c.dual_lr if c.gamma_lr is None else c.gamma_lr) * step_gamma

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        for cid, reply in replies.items():  # duals first: Eq. 13 uses lambda^{t+1}
            self.update_dual(cid, float(reply.scalars["sq_dist"]))
            self.sizes[cid] = reply.num_examples
        return super().aggregate(rnd, replies, phase)

    def aggregation_weights(self, replies: dict[int, Reply]) -> list[float]:
        lams = [float(self.lam[cid]) for cid in replies]
        total = sum(lams)
        if total <= 0.0:  # every lambda is zero: Eq. 13 is 0/0, average uniformly instead
            self.uniform_fallbacks += 1
            return [1.0 / len(lams)] * len(lams)
        return [v / total for v in lams]

    def round_metrics(self, rnd: int) -> dict[str, float]:
        out: dict[str, Any] = {
            "lambda_mean": float(self.lam.mean()),
            "lambda_max": float(self.lam.max()),
            "gamma_mean": float(self.gamma.mean()),
            "uniform_fallbacks": self.uniform_fallbacks,
        }
        known = torch.nonzero(self.sizes > 0).flatten()
        if len(known) == 0:
            return out
        sizes = self.sizes[known].to(torch.float64)
        lam_total = float(self.lam.sum())
        for tag, pos in (("smallest", int(torch.argmin(sizes))), ("largest", int(torch.argmax(sizes)))):
            cid = int(known[pos])
            out[f"data_share_{tag}"] = float(sizes[pos] / sizes.sum())
            out[f"weight_share_{tag}"] = float(self.lam[cid]) / lam_total if lam_total > 0 else None
            out[f"lambda_{tag}"] = float(self.lam[cid])
        return out

    def state_dict(self) -> dict[str, Any]:
        duals = {k: getattr(self, k).clone() for k in ("lam", "gamma", "lam_buf", "gamma_buf", "dual_steps", "sizes")}
        return {**super().state_dict(), **duals, "uniform_fallbacks": self.uniform_fallbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for key in ("lam", "gamma", "lam_buf", "gamma_buf", "dual_steps", "sizes"):
            setattr(self, key, state[key].clone())
        self.uniform_fallbacks = int(state["uniform_fallbacks"])

    # ----------------------------------------------------------------- client side
    def before_local(self, ctx: ClientContext) -> None:
        local = ctx.state.get("local")
        if self.config.warm_start and local is not None:
            ctx.flat.set_params(local)

    def add_prox_grad(self, ctx: ClientContext) -> None:
        """Gradient of lambda_i (||x - z||^2 - gamma_i): 2 lambda_i (x - z); gamma_i is a constant here."""
        lam = float(ctx.message.scalars["lambda"])
        if lam:
            ctx.flat.grad.add_(ctx.flat.params - ctx.global_params, alpha=2.0 * lam)

    def after_backward(self, ctx: ClientContext) -> None:
        self.add_prox_grad(ctx)

    def after_local(self, ctx: ClientContext) -> Reply:
        reply = super().after_local(ctx)
        diff = ctx.flat.params.to(torch.float64) - ctx.global_params.to(torch.float64)
        reply.scalars["sq_dist"] = float(diff.square().sum())
        ctx.state["local"] = ctx.flat.get_params()
        return reply

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        return ctx.state.get("local")


class FedBCFineTuneConfig(FedBCConfig):
    finetune_lr: float = Field(0.01, gt=0.0)  # official --inner_lr default 0.01 (evaluate_local.train_one_step)
    # sensible default for the fine-tuning step: decades around the official inner_lr 0.01
    tunable: ClassVar[dict[str, str]] = {**FedBCConfig.tunable, "finetune_lr": "log:1e-3:1e-1"}
    # True: the paper's protocol, the fine-tuning batch comes from the client's TEST split (test-set leakage);
    # metrics are then logged as personal_leaky_acc_*. False: a batch of the client's training data.
    leaky: bool = False


@ALGORITHMS.register(
    "fedbc_finetune",
    "FedBC-FineTune: FedBC, personalised by one SGD step on a training batch (leaky=true: on test data, marked)",
    FedBCFineTuneConfig,
)
class FedBCFineTune(FedBC):
    name = "fedbc_finetune"
    Config = FedBCFineTuneConfig
    batchable = True  # FedBC's local training; the fine-tuning step runs in personalize, outside the batched loop

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        local = ctx.state.get("local")
        if local is None:
            return None
        return finetune_one_step(ctx, local, self.config.finetune_lr, self.config.leaky)


class PerFedBCConfig(FedBCConfig, MamlParams):
    tunable: ClassVar[dict[str, str]] = {**FedBCConfig.tunable, **MamlParams.tunable}


@ALGORITHMS.register(
    "per_fedbc",
    "Per-FedBC: FedBC with first-order MAML local steps; personalised by one step from the global model",
    PerFedBCConfig,
)
class PerFedBC(MamlMixin, FedBC):
    """The inner steps minimise CE + lambda_i (||w - z||^2 - gamma_i), the outer gradient is plain CE (official
    ``train_MAML`` with ``--alg fedbc``); duals and aggregation are FedBC's."""

    name = "per_fedbc"
    Config = PerFedBCConfig

    def inner_extra_grad(self, ctx: ClientContext) -> None:
        self.add_prox_grad(ctx)

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        return MamlMixin.personalize(self, ctx)
