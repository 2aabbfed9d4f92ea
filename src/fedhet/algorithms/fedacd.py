"""FedACD (Zhou, Ding, Li and Wang, "Enhancing the Performance of Global Model by Improving the Adaptability of Local
Models in Federated Learning"): local models with equal per-class errors, aggregated by a confusion score.

Each client keeps a *probability matrix* P (a soft confusion matrix of its local data: ``P[i, j]`` = mean softmax
probability of class j over its samples of class i; ``fedhet.toolkit.confusion``) and trains on (Eq. 7-9)

    L = L1 + lambda L2,
    L1 = KL(p || q),  q_y = p_y,  q_k = (1 - p_y) / (C - 1) for k != y        (flattens the non-target outputs)
    L2 = CE(f + A[y], y),  A = log P - (log P)^T,  i.e. A[y, i] = log(P_yi / P_iy)   (dynamic logit adjustment)

on input-Mixup batches (one lam ~ Beta(alpha, alpha) per batch, a random permutation as partner, both labels carried
into L1, L2 and P with weights lam and 1 - lam). A column of a class the client lacks gets ``log(delta_missing)``;
P is a statistic (no gradient). After training, the client scores its final model on its clean local data,

    V = sigmoid(1 / KL(P || Q)),   Q = tau on the diagonal, (1 - tau) / (C - 1) elsewhere     (Eq. 10)

and replies with its model and V; the server averages the models with weights V_m / sum_k V_k (Eq. 11, no
sample-size factor), buffers (BatchNorm) with the same weights.

No official code exists; this follows the paper and notes/fedacd.md (sections 2, 3, 8). Where the paper is silent
the choice is a config field whose comment says so. The ones that shape the method:

* when P is refreshed (notes 2.3): by default (``p_estimate = "train_outputs"``, option B) from the soft outputs of
  the training mini-batches of each local epoch, lam-weighted into the rows of both labels; epoch e uses the estimate
  completed at the end of epoch e - 1, epoch 1 a no-grad pass of the received global model over the local data
  (clean by default). ``"clean_pass"`` (option A) re-estimates P with a clean eval-mode pass at each epoch's start.
  An epoch is ceil(n / B) steps of the shared loop, also when ``train.local_steps`` is set;
* KL(P || Q) over the present rows, averaged (``kl_reduction = "mean_rows"``); Eq. 10 literally sums, which makes
  every V about 0.5 for C = 100 and Table 9's magnitudes fit a per-row mean (notes 2.8);
* L1 differentiates through q (the literal formula; ``l1_detach_target`` stops it).

Ablations: ``mixup = false`` (Table 5), ``weighting = "uniform"`` (FedACD_base of Table 8; registered also as
``fedacd_base``) and ``weighting = "samples"``, e.g. ``fedhet run -a fedacd -s algorithm.mixup=false``.

Logged per evaluation (``round_metrics``, from the last aggregated round, checkpointed so a resume logs the same):
``fedacd_score_min/mean/max`` (V_m), ``fedacd_kl_mean`` (KL(P^m || Q), Table 9's quantity for FedACD) and
``fedacd_log_delta_max`` (largest |log Delta| between present classes in the last P used, notes 8.12).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientContext, Reply, Setup
from fedhet.data.device import to_device
from fedhet.toolkit.confusion import probability_matrix, soft_confusion, template_kl

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer

KL_FLOOR = 1e-12  # V = sigmoid(1 / KL) with the KL guarded away from 0: a perfect fit gives V = 1, no error


class FedACDConfig(AlgoConfig):
    l2_weight: float = Field(1.0, ge=0.0)  # lambda of Eq. 9; Sec. 4 and Table 7 (0.5, 1, 1.5, 2: 1 is best)
    tau: float = Field(1.0 - 1e-5, gt=0.0, lt=1.0)  # template diagonal of Eq. 10; Sec. 4 "tau = 1 - 10^-5"
    # "score": Eq. 11, V_m / sum_k V_k; "uniform": FedACD_base of Table 8; "samples": N_m / sum_k N_k (FedAvg's)
    weighting: Literal["score", "uniform", "samples"] = "score"
    # proposal, notes/fedacd.md 2.8; the paper does not say (Eq. 10 sums all C^2 entries: "sum" is that literal
    # reading over the present rows; "mean_rows" divides by their number, which Table 9's magnitudes support)
    kl_reduction: Literal["mean_rows", "sum"] = "mean_rows"
    mixup: bool = True  # Sec. 3 "Input Mixup ... within each local training epoch's minibatch"; false: Table 5's w/o
    # proposal, notes/fedacd.md 2.7 (the common CIFAR value); the paper does not say
    mixup_alpha: float = Field(1.0, gt=0.0)
    # l2_weight: Table 7 sweeps lambda over 0.5-2 (notes/fedacd.md); mixup_alpha: not given, sensible default
    tunable: ClassVar[dict[str, str]] = {"l2_weight": "uniform:0.5:2", "mixup_alpha": "log:0.1:2"}
    # proposal, notes/fedacd.md 2.3 (option B: the mixup rationale implies P comes from the training outputs);
    # the paper does not say. "clean_pass" is option A: a clean no-grad re-estimate at the start of every epoch.
    p_estimate: Literal["train_outputs", "clean_pass"] = "train_outputs"
    # proposal, notes/fedacd.md 2.3: the epoch-1 estimate of option B from the received model on clean local data,
    # or on mixup batches ("mixup", eval mode, no grad); the paper does not say
    p_init: Literal["clean", "mixup"] = "clean"
    # proposal, notes/fedacd.md 3 ("a small value" for Delta of a missing class); the paper does not give it
    delta_missing: float = Field(1e-4, gt=0.0)
    # proposal, notes/fedacd.md 8.3 (clamp P before its log); the paper does not say
    p_floor: float = Field(1e-8, gt=0.0, lt=1.0)
    # proposal, notes/fedacd.md 8.12: clip the estimated log Delta to [-c, c] (not the missing-class value);
    # None = off, the paper's formula; the paper does not say
    log_delta_clip: float | None = Field(None, gt=0.0)
    # proposal, notes/fedacd.md 2.4: False differentiates through q (Eq. 7 as written); the paper does not say
    l1_detach_target: bool = False

    @model_validator(mode="after")
    def _mixup_init_needs_mixup(self) -> FedACDConfig:
        if self.p_init == "mixup" and not self.mixup:
            raise ValueError("p_init='mixup' needs mixup=true")
        if self.p_init == "mixup" and self.p_estimate == "clean_pass":
            raise ValueError("p_init='mixup' applies to p_estimate='train_outputs' only (clean_pass is clean)")
        return self


# ----------------------------------------------------------------------------------------------------- losses
def flatten_loss(logits: torch.Tensor, y: torch.Tensor, detach_target: bool = False) -> torch.Tensor:
    """L1 of Eq. 7 per sample: KL(p || q) with q_y = p_y and q_k = (1 - p_y) / (C - 1) elsewhere.

    log(1 - p_y) is logsumexp of the non-target logits minus logsumexp of all, so p_y -> 1 gives no log(0). The
    y-term is p_y log(p_y / q_y): zero, and without gradient unless q is detached (then it keeps KL's gradient)."""
    num_classes = logits.shape[1]
    target = y.unsqueeze(1) == torch.arange(num_classes, device=y.device)  # one-hot (F.one_hot does not vmap)
    logp = F.log_softmax(logits, dim=1)
    log_rest = torch.logsumexp(logits.masked_fill(target, -math.inf), dim=1) - torch.logsumexp(logits, dim=1)
    logq = torch.where(target, logp, (log_rest - math.log(num_classes - 1)).unsqueeze(1))
    if detach_target:
        logq = logq.detach()
    return (logp.exp() * (logp - logq)).sum(dim=1)


def adjustment_matrix(p: torch.Tensor, delta_missing: float, floor: float, clip: float | None) -> torch.Tensor:
    """A[y, i] = log(P_yi / P_iy) (Eq. 8's log Delta) from a probability matrix whose absent rows are NaN.

    A column of an absent class gets log(delta_missing); absent rows (never a label) are 0; P is clamped to
    ``floor`` first. ``clip`` bounds the estimated entries, not the missing-class value."""
    present = ~torch.isnan(p).any(dim=1)
    log_p = p.clamp_min(floor).log()
    a = log_p - log_p.T
    if clip is not None:
        a = a.clamp(-clip, clip)
    a[:, ~present] = math.log(delta_missing)
    a[~present, :] = 0.0
    a.fill_diagonal_(0.0)
    return a


def adjusted_cross_entropy(logits: torch.Tensor, y: torch.Tensor, adjust: torch.Tensor) -> torch.Tensor:
    """L2 of Eq. 8 per sample: cross-entropy of logits + A[y]."""
    return F.cross_entropy(logits + adjust[y], y, reduction="none")


def score(kl: float) -> float:
    """V = sigmoid(1 / KL) of Eq. 10, the KL guarded at ``KL_FLOOR``."""
    return 1.0 / (1.0 + math.exp(-1.0 / max(kl, KL_FLOOR)))


def draw_beta(alpha: float, generator: torch.Generator) -> float:
    """lam ~ Beta(alpha, alpha) from the client's generator (torch's Beta takes none): a seed from it for numpy."""
    seed = int(torch.randint(2**62, (), generator=generator))
    return float(np.random.default_rng(seed).beta(alpha, alpha))


def draw_mix(alpha: float, n: int, generator: torch.Generator) -> tuple[float, torch.Tensor]:
    """One input-Mixup draw for a batch of n: lam ~ Beta(alpha, alpha) and a random permutation as partners."""
    lam = draw_beta(alpha, generator)
    return lam, torch.randperm(n, generator=generator)


def accumulate(sums: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor, labels: list[tuple]) -> None:
    """Add each sample's probabilities to the rows of its labels, weighted: ``labels`` is [(y, weight), ...]."""
    probs = probs.detach().double().to(sums.device)  # where the sums live: the batch's device, no read-back per step
    for y, weight in labels:
        y = y.to(sums.device)
        sums.index_add_(0, y, probs * weight)
        counts.index_add_(0, y, torch.full((len(y),), float(weight), dtype=torch.float64, device=sums.device))


# ------------------------------------------------------------------------------------------------ algorithm
@ALGORITHMS.register(
    "fedacd",
    "FedACD (Zhou et al.): flattened + confusion-adjusted losses with mixup, aggregation by a confusion score",
    FedACDConfig,
)
class FedACD(Algorithm):
    name = "fedacd"
    Config = FedACDConfig
    # its loss inputs change each step (mixup draw, P refreshed per epoch): read per step (``step_inputs``)
    batchable = True
    step_inputs = True
    weighted_aggregate = True  # aggregate records V, then runs the base weighted average (GNE applies)

    def __init__(self, config: FedACDConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self.last_round: dict[str, float] = {}  # V and KL of the last aggregated round, for round_metrics

    # ----------------------------------------------------------------- server side
    def aggregation_weights(self, replies: dict[int, Reply]) -> list[float]:
        if self.config.weighting == "uniform":
            return [1.0 / len(replies)] * len(replies)
        if self.config.weighting == "samples":
            return super().aggregation_weights(replies)
        scores = [float(r.scalars["score"]) for r in replies.values()]
        total = sum(scores)
        return [s / total for s in scores]

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        scores = [float(r.scalars["score"]) for r in replies.values()]
        kls = [float(r.metrics["kl"]) for r in replies.values()]
        self.last_round = {
            "score_min": min(scores),
            "score_mean": sum(scores) / len(scores),
            "score_max": max(scores),
            "kl_mean": sum(kls) / len(kls),
            "log_delta_max": max(float(r.metrics["log_delta_max"]) for r in replies.values()),
        }
        return super().aggregate(rnd, replies, phase)

    def round_metrics(self, rnd: int) -> dict[str, float]:
        return {f"fedacd_{k}": v for k, v in self.last_round.items()}

    def state_dict(self) -> dict[str, Any]:
        # the last round's V statistics are logged at the next evaluation: kept so a resumed run logs the same
        return {**super().state_dict(), "last_round": dict(self.last_round)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_round = dict(state["last_round"])

    # ----------------------------------------------------------------- client side
    def before_local(self, ctx: ClientContext) -> None:
        cfg = self.config
        t = ctx.train
        ctx.scratch["acd_epoch_steps"] = math.ceil(len(ctx.data) / t.batch_size)
        if cfg.p_estimate == "train_outputs" and cfg.p_init == "mixup":
            self.set_p(ctx, self.mixup_pass(ctx))
        else:
            self.set_p(ctx, self.clean_pass(ctx))
        self.reset_sums(ctx)

    def clean_pass(self, ctx: ClientContext) -> torch.Tensor:
        """P of the current model on the clean local training data (eval mode, no gradient)."""
        # the training batch size: on CPU, batches of 256 ran 1.5x slower than 64 for the CNN (cache), one thread
        data = ctx.data
        return probability_matrix(*soft_confusion(ctx.model, data.x, data.y, data.num_classes, ctx.train.batch_size))

    @torch.no_grad()
    def mixup_pass(self, ctx: ClientContext) -> torch.Tensor:
        """P of the current model on mixup batches of the local data in order (eval mode, no gradient)."""
        n, c = len(ctx.data), ctx.data.num_classes
        device = ctx.data.x.device
        sums = torch.zeros(c, c, dtype=torch.float64, device=device)
        counts = torch.zeros(c, dtype=torch.float64, device=device)
        was_training = ctx.model.training
        ctx.model.eval()
        for start in range(0, n, ctx.train.batch_size):
            x, y = ctx.data.x[start : start + ctx.train.batch_size], ctx.data.y[start : start + ctx.train.batch_size]
            x, labels = self.mix(ctx, x, y)
            accumulate(sums, counts, torch.softmax(ctx.model(x), dim=1), labels)
        ctx.model.train(was_training)
        return probability_matrix(sums.cpu(), counts.cpu())

    def set_p(self, ctx: ClientContext, p: torch.Tensor) -> None:
        cfg = self.config
        ctx.scratch["acd_p"] = p
        adjust = adjustment_matrix(p, cfg.delta_missing, cfg.p_floor, cfg.log_delta_clip)
        ctx.scratch["acd_adjust"] = to_device(adjust.to(torch.float32), ctx.data.x.device)
        present = ~torch.isnan(p).any(dim=1)
        ctx.scratch["acd_log_delta_max"] = float(adjust[present][:, present].abs().max())  # notes 8.12: its range

    def reset_sums(self, ctx: ClientContext) -> None:
        c = ctx.data.num_classes
        # on the data's device, read once per epoch (refresh_p), not per step
        ctx.scratch["acd_sums"] = torch.zeros(c, c, dtype=torch.float64, device=ctx.data.x.device)
        ctx.scratch["acd_counts"] = torch.zeros(c, dtype=torch.float64, device=ctx.data.x.device)

    def refresh_p(self, ctx: ClientContext) -> None:
        """At an epoch boundary: P from the finished epoch's training outputs (option B) or a clean pass (A)."""
        if self.config.p_estimate == "clean_pass":
            self.set_p(ctx, self.clean_pass(ctx))
            return
        estimate = probability_matrix(ctx.scratch["acd_sums"].cpu(), ctx.scratch["acd_counts"].cpu())
        seen = ~torch.isnan(estimate).any(dim=1)  # a row with no weight this epoch keeps its previous estimate
        self.set_p(ctx, torch.where(seen.unsqueeze(1), estimate, ctx.scratch["acd_p"]))
        self.reset_sums(ctx)

    def draw_mix(self, ctx: ClientContext, n: int) -> tuple[float, torch.Tensor]:
        """One mixup draw per mini-batch from the client's generator (a method, so a test can fix the draw)."""
        return draw_mix(self.config.mixup_alpha, n, ctx.generator)

    def mix(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
        """Input Mixup: the mixed batch and its [(labels, weight), ...]; the batch itself without mixup."""
        if not self.config.mixup:
            return x, [(y, 1.0)]
        lam, perm = self.draw_mix(ctx, len(y))
        perm = to_device(perm, y.device)
        return lam * x + (1.0 - lam) * x[perm], [(y, lam), (y[perm], 1.0 - lam)]

    def loss_inputs(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        """Read at every step, before its loss: P refreshed at an epoch boundary, then this batch's mixup draw."""
        if ctx.steps and ctx.steps % ctx.scratch["acd_epoch_steps"] == 0:
            self.refresh_p(ctx)
        inputs = {"adjust": ctx.scratch["acd_adjust"]}
        if self.config.mixup:
            lam, perm = self.draw_mix(ctx, len(ctx.batch))
            # lam and 1 - lam rounded from float64 as a Python scalar would be: the products are the same
            mix = torch.tensor([lam, 1.0 - lam], dtype=ctx.data.x.dtype)
            inputs["mix"] = to_device(mix, ctx.data.x.device)
            inputs["perm"] = to_device(perm, ctx.data.x.device)
            ctx.scratch["acd_mix"] = (lam, inputs["perm"])  # after_step's labels: the partners already on the device
        return inputs

    def loss(
        self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        labels: list[tuple[torch.Tensor, Any]] = [(y, 1.0)]
        if "mix" in inputs:
            mix, perm = inputs["mix"], inputs["perm"]
            x = mix[0] * x + mix[1] * x[perm]
            labels = [(y, mix[0]), (y[perm], mix[1])]
        logits = model(x)
        loss = logits.new_zeros(())
        for labels_k, weight in labels:
            per_sample = flatten_loss(logits, labels_k, self.config.l1_detach_target)
            per_sample = per_sample + self.config.l2_weight * adjusted_cross_entropy(logits, labels_k, inputs["adjust"])
            loss = loss + weight * per_sample.mean()
        if self.config.p_estimate != "train_outputs":
            return loss
        return loss, {"acd_probs": torch.softmax(logits, dim=1), "acd_labels": y}  # accumulated by after_step

    def after_step(self, ctx: ClientContext) -> None:
        if self.config.p_estimate != "train_outputs":
            return
        aux = ctx.scratch["loss_aux"]
        probs, y = aux["acd_probs"].pop(), aux["acd_labels"].pop()
        labels = [(y, 1.0)]
        if self.config.mixup:
            lam, perm = ctx.scratch["acd_mix"]
            labels = [(y, lam), (y[perm], 1.0 - lam)]
        accumulate(ctx.scratch["acd_sums"], ctx.scratch["acd_counts"], probs, labels)

    def after_local(self, ctx: ClientContext) -> Reply:
        reply = super().after_local(ctx)
        kl = template_kl(self.clean_pass(ctx), self.config.tau, self.config.kl_reduction)
        v = score(kl)
        reply.scalars["score"] = v
        reply.metrics.update(kl=kl, score=v, log_delta_max=ctx.scratch["acd_log_delta_max"])
        return reply


class FedACDBaseConfig(FedACDConfig):
    weighting: Literal["score", "uniform", "samples"] = "uniform"  # FedACD_base of Table 8: uniform weights


@ALGORITHMS.register(
    "fedacd_base", "FedACD_base (Table 8): FedACD's local training, uniform aggregation weights", FedACDBaseConfig
)
class FedACDBase(FedACD):
    name = "fedacd_base"
    Config = FedACDBaseConfig
    batchable = True  # FedACD's client (the declaration is not inherited); only the server's weights differ
