"""FedRANE (Liao et al., ACM MM 2023): local Relational Augmentation (LRA) on the clients, aggregation by a global
Nash Equilibrium (GNE) on the server.

Client (Sec. 3.3). ``prepare_model`` puts the LRA block (``fedhet.models.lra``) between the model's body and its
head, so the head becomes the predictor and reads the augmented representation. Per mini-batch, with z = body(x):

    z~ = LRA(z)                            Pearson graph -> SLIM relation matrix -> attentive message passing
    L  = CE(predictor(z~), y) + lambda_CD * L_CD(z, z~)                                      (Eq. 8-9)
    L_CD = -1/B sum_i log( e^{sim(z_i, z~_i)/tau} / sum_{j != i} e^{sim(zhat_i, zhat_j)/tau} ),
           zhat = [z; z~], sim = Pearson correlation                                          (Eq. 7)

The LRA parameters (W, W_m, W_n per step) are part of the exchanged and aggregated vector, as the whole model is
("each client k uploads its model parameters"). After training, each client keeps its local model as client state:
that is its personalised model (P-FL, Algorithm 1's outputs {theta_k^T}, notes gotcha 12), returned by
``personalize``; the global model is the G-FL one.

Server (Sec. 3.4). The aggregation is the GNE aggregation (``aggregation = "gne"``: ``fedhet/algorithms/gne.py``,
written once for every method; ``__init__`` installs it with its defaults, the Newton solver and weights summed to
one as in the official code) or sample-ratio averaging (``"samples"``, FedRANE-w/o-GNE). GNE's own settings come
from ``[server]``: ``server.aggregation = "gne"`` with ``server.gne_solver`` / ``gne_normalize`` / ``gne_jitter``
replaces the default GNE; with the w/o-GNE preset it is a contradiction and refused. BatchNorm buffers are averaged
by sample ratio (notes gotcha 14).

Evaluation. LRA is batch-dependent. With ``lra_at_eval`` (default: the paper's predictor "infers the sample label
based on the augmented sample representation") the model evaluates in chunks of exactly ``eval_batch_size``
samples, in the test set's order, and the engine cuts every test set (and each client's split separately) at that
size whatever ``run.eval_batch_size`` is, so no number depends on how the data were cut. ``lra_at_eval = false``
predicts from z itself (the official evaluation, ``predictor(normalize(base(x)))``).

Measured (digits, 6 clients of a Dirichlet(0.5) split, full participation, MLP with d = 32, 10 rounds of 5 local
epochs at B = 32, lr 0.05, momentum 0.9; test accuracy): FedAvg 0.953 (``fedrane_wo_lra`` with sample weights:
the same bits), FedRANE-w/o-GNE with ``relation_form`` eq4 and one solve (the default) 0.862, eq4 with
``slim_iters = 3`` 0.564, kkt (3 alternations) 0.773, oneshot 0.838; kkt without LRA at evaluation 0.636. Iterating
Phi with Eq. 4 as printed degrades the graph: on a batch of 128 digits the share of same-class pairs among the
top-10 neighbours falls from 0.53 (first solve, Phi = I, where Eq. 4 is exact) to 0.23 after three alternations,
while the exact KKT solve stays at 0.58; hence one solve by default (the official code's count too).
On Fashion-MNIST (``train_fraction`` 0.1, 20 clients, Dirichlet 0.5, ``convnet`` with d = 64, 10 rounds of 2 local
epochs at B = 128, lr 0.05, momentum 0.9): FedAvg 0.725, FedRANE-w/o-GNE eq4 with one solve 0.519, with 3 0.293,
kkt 0.516. z~_i is built from the neighbours alone (no self term), so LRA learns more slowly than a plain model.
``residual_mix`` m (not in the paper, default 0) lets the predictor read m z + (1 - m) z~ instead, as the official
code's unused ``LocalGModel`` does with m = 0.9 (docs/reproductions/fedrane.md, "What LRA does to a sample's
representation").

Presets: ``fedrane_wo_lra`` (no LRA block, no CD term: the CD loss needs z~, notes gotcha 16; GNE) and
``fedrane_wo_gne`` (LRA + CD, sample-ratio averaging), the ablation rows of Tables 1-2.

The paper's training setting (Sec. 4.1) belongs to ``[train]``: SGD, lr 0.5, batch 128, 5 local epochs, all 20
clients every round; momentum and weight decay are not given (the official code: 0.9 and 1e-5).

Sources: the paper (papers/000_92eea7ebf6cf3cb5.txt), notes/fedrane.md (readings of what the paper leaves open),
and the official code ``XeniaLLL/HyperFed_and_FedRANE-master`` (``clientFedRANE.py``, ``graph_generator.py``,
``graph_models.py``), read for the open details only. Where it differs from the paper we follow the paper; each
difference that is a choice here is a config field whose comment names the official value. Options that give the
official code's forms: its one-shot EASE graph, its symmetric cosine NT-Xent, its L2-normalised z and z~
(``normalize``), SphereFed's fixed orthonormal predictor (``predictor = "fixed"``), its MSE loss (``pred_loss``),
its GAT attention (``attention = "gat"``, ``fedhet.models.lra``) and its mixup term (``mixup_weight``: the
cross-entropy of a mixed batch's augmented features read as logits over the d feature coordinates, weighted 10).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from fedhet.algorithms.base import ALGORITHMS, AlgoConfig, Algorithm, ClientContext, Reply, Setup
from fedhet.algorithms.fedacd import draw_mix
from fedhet.algorithms.fednh import init_prototypes
from fedhet.algorithms.gne import GNE
from fedhet.algorithms.spherefed import SphereHead
from fedhet.data.device import to_device
from fedhet.errors import ConfigError
from fedhet.models.base import FedModel
from fedhet.models.lra import (
    Attention,
    LRASettings,
    Neighbourhood,
    Normalized,
    RelationForm,
    attach_lra,
    contrastive_discrimination,
)

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer

LOCAL = "local_params"  # client state: the client's model after its last local training (its P-FL model)


class FedRANEConfig(AlgoConfig):
    # ---- components (Sec. 3; the ablations switch them off)
    lra: bool = True  # False: FedRANE-w/o-LRA, the plain extractor -> predictor (Tables 1-2)
    # "gne": the GNE aggregation (Sec. 3.4); "samples": FedAvg's sample-ratio weights (FedRANE-w/o-GNE)
    aggregation: Literal["gne", "samples"] = "gne"
    # predictor depth, not given ("a multi-perception layer module"): 1 = the model's own Linear(d, C) head (the
    # official code's fc; notes' first proposal), 2 = Linear(d, d) -> ReLU -> that head (notes' second proposal)
    predictor_layers: Literal[1, 2] = 1
    # ---- the official code's representation and predictor (not in the paper; notes 2.1 and 2.4)
    # True: z is L2-normalised before LRA and z~ after it, so the predictor and the CD loss read unit vectors
    # (official: F.normalize(base(x)) and F.normalize(gnn(z, A))); the paper normalises nothing
    normalize: bool = False
    # "learned": the model's own Linear(d, C) head, trained (paper); "fixed": SphereFed's classifier, orthonormal rows
    # on the unit sphere, no bias, never trained, reading z~ / |z~| (official: the server's QR-orthogonal predictor
    # with requires_grad = False)
    predictor: Literal["learned", "fixed"] = "learned"
    # "ce": Eq. 8's cross-entropy on predictor(z~) (official train_raw, unscaled); "mse": the mean over batch and
    # classes of (predictor(z~) - onehot(y))^2 (official train_graph / train_sam, nn.MSELoss)
    pred_loss: Literal["ce", "mse"] = "ce"
    # ---- contrastive discrimination (Eq. 7, 9)
    lambda_cd: float = Field(0.2, ge=0.0)  # lambda_CD = 0.2 (Sec. 4.1); official nce_reg default 0.1
    temperature: float = Field(0.8, gt=0.0, le=1.0)  # tau_1 = 0.8 (Sec. 4.1; official info_nce_temperature 0.8)
    cd_similarity: Literal["pearson", "cosine"] = "pearson"  # "Pearson coefficient as similarity"; official cosine
    # False: Eq. 7 as printed, the B original samples as anchors; True: NT-Xent over all 2B (official code)
    cd_symmetric: bool = False
    # ---- sample relational mining (Eq. 2-4)
    lambda_r: float = Field(0.1, gt=0.0)  # lambda_R = 0.1 (Sec. 4.1; official GraphGenerator reg 0.1)
    # Sec. 4.2's sensitivity grids (notes/fedrane.md): lambda_CD in {0, 0.1, 0.5, 0.81}, tau_1 in {0.1, 0.2, 0.5,
    # 0.8, 1}; lambda_R: not studied, sensible range around 0.1
    tunable: ClassVar[dict[str, str]] = {
        "lambda_cd": "uniform:0:1",
        "temperature": "uniform:0.1:1",
        "lambda_r": "log:1e-2:1",
    }
    # "eq4": Eq. 4 as printed; "kkt": the exact constrained solution for a non-diagonal Phi + Phi^T (notes 2.2(b)4);
    # "oneshot": the official code's single EASE solve on P with no Phi iteration (notes 2.2(b)7)
    relation_form: RelationForm = "eq4"
    # "until it converges" (Sec. 3.3). Default 1 solve, as the official code: Eq. 4 is exact only at the first solve
    # (Phi = I), and iterating it as printed degraded the graph and learning (docstring: digits 0.862 with 1 solve,
    # 0.564 with 3); the notes' small cap (3) with a tolerance on the change of Bm is slim_iters = 3.
    slim_iters: int = Field(1, ge=1)
    slim_tol: float = Field(1e-4, ge=0.0)
    eig_floor: float = Field(1e-6, gt=0.0, lt=1.0)  # Phi's eigenvalue floor, relative to the largest (notes 2.2(b)3)
    # ---- attentive message passing (Eq. 5-6)
    # N_i: "topk" the k strongest relations (notes' proposal), "all" every j != i with A_ij > 0 (official mask)
    neighbourhood: Neighbourhood = "topk"
    topk: int = Field(10, ge=1)  # notes' proposal k = 10
    self_loop: bool = False  # diag(Bm) = 0 excludes i from N_i (paper, literally); True adds it
    steps: int = Field(1, ge=1)  # L, not given: notes' proposal 1 (official graph_n_hops 1)
    # "dot": Eq. 6's dot-product scores (W_m h_i).(W_n h_j), softmax over N_i (the paper); "gat": the official code's
    # default gnn_type, a GAT layer of gat_heads heads (LeakyReLU 0.1 scores, ELU, heads averaged, dropout)
    attention: Attention = "dot"
    gat_heads: int = Field(2, ge=1)  # official num_heads = 2
    gat_dropout: float = Field(0.2, ge=0.0, lt=1.0)  # official GAT dropout 0.2, applied in training only
    # ---- the official code's mixup term (train_raw; not in the paper). Each batch also passes a mixup of itself,
    # lam x + (1 - lam) x[perm] with lam ~ Beta(mixup_alpha, mixup_alpha), through the extractor and LRA on its own
    # graph; its CD loss is added, and mixup_weight * (lam CE(v, y) + (1 - lam) CE(v, y[perm])), where v is the
    # mixed batch's augmented representation (unit with normalize; z itself without LRA) read directly as logits over
    # its d coordinates, so label c scores feature c (needs d >= C). 0 = off (paper); official 10 (train_raw's factor,
    # the graph's alpha = 0 so the mixed z~ is used as is) with mixup_data's alpha 0.5.
    mixup_weight: float = Field(0.0, ge=0.0)
    mixup_alpha: float = Field(0.5, gt=0.0)
    # ---- the predictor's input (not in the paper; docs/reproductions/fedrane.md). The predictor reads
    # m z + (1 - m) z~: 0 = the paper (Eq. 5 has no self or residual term, z~ replaces z); the official code's
    # unused LocalGModel mixes with 0.9. The CD loss and the mixup term still read z~ itself
    residual_mix: float = Field(0.0, ge=0.0, le=1.0)
    # ---- evaluation (notes 2.5: LRA at test time is not specified)
    lra_at_eval: bool = True  # paper's framework (predictor reads z~); official evaluation skips LRA (False)
    eval_batch_size: int = Field(128, ge=2)  # the fixed test batch LRA sees (notes' proposal: B = 128)
    # below this size a batch has no usable correlation and LRA passes it through (notes: guard tiny last batches)
    min_batch: int = Field(2, ge=2)

    @model_validator(mode="after")
    def _cd_needs_lra(self) -> FedRANEConfig:
        if self.lambda_cd > 0 and not self.lra:
            raise ValueError("lambda_cd > 0 needs lra = true (the CD loss compares z with z~); set lambda_cd = 0")
        if self.residual_mix > 0 and not self.lra:
            raise ValueError("residual_mix > 0 mixes z with LRA's z~: it needs lra = true")
        if self.predictor == "fixed" and self.predictor_layers != 1:
            raise ValueError("predictor = 'fixed' is one fixed linear map; it needs predictor_layers = 1")
        return self

    def lra_settings(self) -> LRASettings:
        return LRASettings(
            lambda_r=self.lambda_r,
            relation_form=self.relation_form,
            slim_iters=self.slim_iters,
            slim_tol=self.slim_tol,
            eig_floor=self.eig_floor,
            neighbourhood=self.neighbourhood,
            topk=self.topk,
            self_loop=self.self_loop,
            steps=self.steps,
            attention=self.attention,
            gat_heads=self.gat_heads,
            gat_dropout=self.gat_dropout,
            min_batch=self.min_batch,
            at_eval=self.lra_at_eval,
            eval_batch=self.eval_batch_size,
        )


@ALGORITHMS.register(
    "fedrane",
    "FedRANE (Liao et al. 2023): local relational augmentation + contrastive discrimination, GNE aggregation",
    FedRANEConfig,
)
class FedRANE(Algorithm):
    name = "fedrane"
    Config = FedRANEConfig
    unbatchable_reason = "its loss reads ctx.model and the generator directly (not ported to the functional loss)"
    personalized = True  # P-FL: each client's model after its last local training

    @classmethod
    def prepare_model(cls, config: FedRANEConfig, model: FedModel) -> FedModel:
        d = model.embedding_dim
        if config.mixup_weight > 0 and d < model.num_classes:
            raise ConfigError(
                f"algorithm.mixup_weight > 0 reads the {d}-d representation as logits over {model.num_classes} "
                "classes, which needs a width of at least the class count; widen the model or set mixup_weight = 0"
            )
        if config.predictor == "fixed":  # drawn from the run-seeded generator, a buffer that travels with the model
            model.head = SphereHead(init_prototypes(model.num_classes, d))
        if config.predictor_layers == 2:
            model.head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), model.head)
        if config.lra:
            attach_lra(model, config.lra_settings(), config.normalize, config.residual_mix)
        elif config.normalize:
            model.head = Normalized(model.head)
        return model

    def __init__(self, config: FedRANEConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        # ===== GNE wiring: FedRANE's server takes the GNE aggregation (algorithms/gne.py) unless it is the w/o-GNE
        # ablation. server.aggregation = "gne" replaces this GNE by one with the [server] section's gne_* settings.
        if config.aggregation == "gne":
            self.use_gne(GNE())

    def use_gne(self, gne: GNE) -> None:
        if self.config.aggregation == "samples":
            raise ConfigError(
                f"{self.name} is FedRANE with sample-ratio aggregation (algorithm.aggregation = 'samples'); "
                "server.aggregation = 'gne' contradicts it: use algorithm.aggregation = 'gne' instead"
            )
        super().use_gne(gne)

    # ----------------------------------------------------------------- client side
    def local_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if cfg.mixup_weight == 0:
            return self.supervised_loss(ctx.model, ctx.model.body(x), y)
        # the official train_raw: one extractor pass over [x; mixup(x)], each half augmented on its own graph
        lam, perm = draw_mix(cfg.mixup_alpha, len(y), ctx.generator)
        perm = to_device(perm, y.device)
        z = ctx.model.body(torch.cat([x, lam * x + (1.0 - lam) * x[perm]]))
        loss = self.supervised_loss(ctx.model, z[: len(y)], y)
        v, cd = self.augmented(ctx.model, z[len(y) :])
        mixup = lam * F.cross_entropy(v, y) + (1.0 - lam) * F.cross_entropy(v, y[perm])
        loss = loss + cfg.mixup_weight * mixup
        return loss if cd is None else loss + cd

    def supervised_loss(self, model: FedModel, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Eq. 9: the prediction loss on z~ plus lambda_CD * L_CD (without LRA: the head's loss on z alone)."""
        if not self.config.lra:
            return self.prediction_loss(model.head(z), y)
        z, z_aug, cd = self.pair_and_cd(model, z)
        loss = self.prediction_loss(model.head.predictor(model.head.mix(z, z_aug)), y)
        return loss if cd is None else loss + cd

    def augmented(self, model: FedModel, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The augmented representation (z~, or z without LRA; unit with ``normalize``) and the weighted CD loss
        (None when there is none). The mixup term reads it; the predictor reads ``head.mix`` of it."""
        cfg = self.config
        if not cfg.lra:
            return (F.normalize(z, dim=1) if cfg.normalize else z), None
        _, z_aug, cd = self.pair_and_cd(model, z)
        return z_aug, cd

    def pair_and_cd(self, model: FedModel, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(z, z~) as LRA's head returns them (unit with ``normalize``) and the weighted CD loss (None without)."""
        cfg = self.config
        z, z_aug = model.head.pair(z)
        if cfg.lambda_cd == 0:
            return z, z_aug, None
        cd = contrastive_discrimination(z, z_aug, cfg.temperature, cfg.cd_similarity, cfg.cd_symmetric)
        return z, z_aug, cfg.lambda_cd * cd

    def prediction_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.config.pred_loss == "mse":
            return F.mse_loss(logits, F.one_hot(y, logits.shape[1]).to(logits.dtype))
        return F.cross_entropy(logits, y)

    def after_local(self, ctx: ClientContext) -> Reply:
        reply = super().after_local(ctx)
        ctx.state[LOCAL] = reply.tensors["params"].clone()
        return reply

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        return ctx.state.get(LOCAL)


# ------------------------------------------------------------------------------------------------ ablations
class FedRANEWithoutLRAConfig(FedRANEConfig):
    lra: bool = False  # FedRANE-w/o-LRA (Tables 1-2): extractor -> predictor
    lambda_cd: float = Field(0.0, ge=0.0)  # no CD term: it compares z with z~, which w/o-LRA has not (gotcha 16)
    tunable: ClassVar[dict[str, str]] = {}  # without LRA there is no CD term and no relation to tune


@ALGORITHMS.register(
    "fedrane_wo_lra",
    "FedRANE-w/o-LRA (ablation): plain extractor -> predictor, no CD loss, GNE",
    FedRANEWithoutLRAConfig,
)
class FedRANEWithoutLRA(FedRANE):
    name = "fedrane_wo_lra"
    Config = FedRANEWithoutLRAConfig


class FedRANEWithoutGNEConfig(FedRANEConfig):
    aggregation: Literal["gne", "samples"] = "samples"  # FedRANE-w/o-GNE: sample-ratio averaging (Sec. 4.2)


@ALGORITHMS.register(
    "fedrane_wo_gne", "FedRANE-w/o-GNE (ablation): LRA + CD, sample-ratio averaging", FedRANEWithoutGNEConfig
)
class FedRANEWithoutGNE(FedRANE):
    name = "fedrane_wo_gne"
    Config = FedRANEWithoutGNEConfig
