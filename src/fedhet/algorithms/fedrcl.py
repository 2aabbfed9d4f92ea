"""FedRCL (Seo, Kim, Kim and Han, CVPR 2024): federated relaxed contrastive learning.

Local loss = CE + (1/L) Σ_l [ L_scl(φ_l) + β · L_pen(φ_l) ], over the L feature levels φ_l of the model (for
ResNet-18: conv1, conv2_x .. conv5_x; paper Sec. 4.4, Alg. 1). Each level's stage output is global-average-pooled
and L2-normalised, and s_ij is the cosine similarity of samples i and j within the mini-batch (the only pool: no
memory bank, no projection head, no second view). The server averages uniformly (Alg. 1 line 16). Nothing but
model weights is exchanged. All terms are computed in log space (log-sum-exp, softplus): with τ = 0.05 the
self-similarity term e^{1/τ} = e^20 would overflow half precision and lose accuracy in single precision.

Two variants (notes/fedrcl.md section 2.4):

* ``official`` (default; the released code ``skynbe/FedRCL``, ``utils/loss.py``, which produced the published
  tables). Per anchor i: the positive is the *hardest* same-class sample, s_pos = min_{y_j = y_i} s_ij with the
  anchor itself included (so s_pos = 1 when i is alone in its class); the negatives are the ``topk_neg`` most
  similar other-class samples (missing ones drop out);
  L_scl(i) = −log softmax([s_pos, s_neg_1, s_neg_2] / τ)[0]. The penalty looks at the least similar *other*
  same-class sample, c_i = min_{j ≠ i, y_j = y_i} s_ij, and fires only when c_i ≥ λ:
  L_pen(i) = log(1 + e^{(c_i − 1)/τ}) = softplus((c_i − 1)/τ). Anchors whose penalty does not fire get 0; the
  released code adds the constant softplus(−2/τ) ≈ 4e-18 for them instead, which has no gradient.
* ``paper`` (Eq. 5 with the normalisation of App. B / SupCon, notes section 2.4 item 5). Per anchor i with
  positives Pos(i) = {j ≠ i : y_j = y_i}:
  L_scl(i) = (1/|Pos(i)|) Σ_{j ∈ Pos(i)} [ −s_ij/τ + log Σ_{k ≠ i} e^{s_ik/τ} ] (0 when Pos(i) is empty) and
  L_pen(i) = log( Σ_{k ∈ P(i)} e^{s_ik/τ} + e^{1/τ} ) − 1/τ = log(1 + Σ_{k ∈ P(i)} e^{(s_ik − 1)/τ}) with
  P(i) = {k ∈ Pos(i) : s_ik > λ}; the constant 1/τ is removed so the penalty is 0 when P(i) is empty.

Both are averaged over the B anchors of the batch, then over the levels.

Not done, against the official code: its per-local-epoch extra lr decay (×0.998 per epoch, on top of the per-round
decay the engine applies to every algorithm), mixed precision, and its frozen global model whose feature-alignment
and prox losses carry weight 0 (they do not change the gradient). Gradient clipping at norm 10 is the engine's
``train.grad_clip``; the benchmark configs set it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedhet.algorithms.base import ALGORITHMS
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.models.base import FedModel


class FedRCLConfig(FedAvgConfig):
    weighting: Literal["samples", "uniform"] = "uniform"  # Alg. 1 line 16; official Server.aggregate: plain mean
    # "official": hard-mined loss of skynbe/FedRCL (reproduces the published tables); "paper": Eq. 5 in full.
    variant: Literal["official", "paper"] = "official"
    tau: float = Field(0.05, gt=0.0)  # temperature τ, paper Sec. 5.1
    threshold: float = Field(0.7, ge=-1.0, le=1.0)  # similarity threshold λ, paper Sec. 5.1
    beta: float = Field(1.0, ge=0.0)  # penalty weight β, paper Sec. 5.1 (2 for MobileNet-V2, Table C); 0 = FedSCL
    topk_neg: int = Field(2, ge=1)  # hardest negatives per anchor, official configs/client/fedrcl.yaml (official)
    # beta: the paper's sensitivity sweep (notes/fedrcl.md, Fig. 4); tau and threshold are fixed in the paper (0.05,
    # 0.7): sensible ranges around them
    tunable: ClassVar[dict[str, str]] = {
        "beta": "choice:0,0.1,0.2,0.5,1,2,5",
        "tau": "log:0.01:0.5",
        "threshold": "uniform:0.5:0.9",
    }
    # Feature taps to contrast; None = the model's `contrastive_levels` (ResNet-18: conv1, conv2_x..conv5_x, paper
    # Sec. 4.4), else every tap of `forward_features` (all body stages, never the logits).
    levels: tuple[str, ...] | None = None
    feature_relu: bool = False  # official `feature_relu: False`: ResNet taps are taken before the stage's last ReLU


def pooled_unit(feature: torch.Tensor) -> torch.Tensor:
    """(B, C, ...) stage output -> (B, C) average over the spatial positions, then L2-normalised."""
    if feature.dim() > 2:
        feature = feature.flatten(2).mean(2)
    return F.normalize(feature, dim=1)


def rcl_official(z: torch.Tensor, y: torch.Tensor, tau: float, threshold: float, topk_neg: int):
    """Per-anchor (L_scl, L_pen) of the released code for unit-norm features z (B, D)."""
    s = z @ z.T
    same = y[:, None] == y[None, :]
    others = same & ~torch.eye(len(y), dtype=torch.bool, device=z.device)
    s_pos = s.masked_fill(~same, float("inf")).amin(1)  # hardest positive, the anchor itself included
    s_neg = s.masked_fill(same, float("-inf")).topk(min(topk_neg, len(y)), dim=1).values  # missing ones: -inf
    logits = torch.cat([s_pos[:, None], s_neg], dim=1) / tau
    scl = torch.logsumexp(logits, dim=1) - logits[:, 0]
    c = s.masked_fill(~others, float("inf")).amin(1)  # least similar other same-class sample
    fires = others.any(1) & (c >= threshold)
    c = torch.where(fires, c, torch.full_like(c, -1.0))  # the released code's -1; keeps inf out of softplus
    pen = torch.where(fires, F.softplus((c - 1) / tau), torch.zeros_like(c))
    return scl, pen


def rcl_paper(z: torch.Tensor, y: torch.Tensor, tau: float, threshold: float):
    """Per-anchor (L_scl, L_pen) of Eq. 5 (positives averaged, penalty once per anchor) for unit-norm z (B, D)."""
    b = len(y)
    if b < 2:  # no pairs at all: both terms are empty
        zero = z.sum(1) * 0
        return zero, zero
    s = z @ z.T
    eye = torch.eye(b, dtype=torch.bool, device=z.device)
    pos = (y[:, None] == y[None, :]) & ~eye
    logits = s / tau
    log_denominator = torch.logsumexp(logits.masked_fill(eye, float("-inf")), dim=1)  # Σ over k != i
    pair_terms = (log_denominator[:, None] - logits).masked_fill(~pos, 0.0)
    scl = pair_terms.sum(1) / pos.sum(1).clamp(min=1)
    # log(1 + Σ_P e^{(s-1)/τ}) as a log-sum-exp over [0, (s_ik - 1)/τ for k in P]; the 0 keeps every row finite.
    excess = ((s - 1) / tau).masked_fill(~(pos & (s > threshold)), float("-inf"))
    pen = torch.logsumexp(torch.cat([torch.zeros_like(s[:, :1]), excess], dim=1), dim=1)
    return scl, pen


def rcl_loss(features: list[torch.Tensor], y: torch.Tensor, cfg: FedRCLConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean over levels of the anchor-averaged L_scl, same for L_pen); the local loss adds CE + scl + β pen."""
    scls, pens = [], []
    for feature in features:
        z = pooled_unit(F.relu(feature) if cfg.feature_relu else feature)
        if cfg.variant == "official":
            scl, pen = rcl_official(z, y, cfg.tau, cfg.threshold, cfg.topk_neg)
        else:
            scl, pen = rcl_paper(z, y, cfg.tau, cfg.threshold)
        scls.append(scl.mean())
        pens.append(pen.mean())
    return torch.stack(scls).mean(), torch.stack(pens).mean()


def resolve_levels(model: FedModel, levels: tuple[str, ...] | None) -> tuple[str, ...]:
    chosen = levels or getattr(model, "contrastive_levels", model.feature_names)
    unknown = [name for name in chosen if name not in model.feature_names]
    if unknown or not chosen:
        raise ValueError(f"fedrcl levels {list(chosen)} must be taps of the model: {list(model.feature_names)}")
    return tuple(chosen)


@ALGORITHMS.register(
    "fedrcl",
    "FedRCL (Seo et al. 2024): CE + relaxed supervised contrastive loss on every stage's features",
    FedRCLConfig,
)
class FedRCL(FedAvg):
    name = "fedrcl"
    Config = FedRCLConfig
    batchable = True  # batch statistics only within a client's own batch (algorithms/functional.py)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        logits, features = model.forward_features(x)
        levels = resolve_levels(model, self.config.levels)  # the architecture's taps, checked
        scl, pen = rcl_loss([features[name] for name in levels], y, self.config)
        return F.cross_entropy(logits, y) + scl + self.config.beta * pen
