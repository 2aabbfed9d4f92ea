"""MOON (Li, He and Song 2021, "Model-Contrastive Federated Learning").

Local loss = CE + μ · ℓ_con, with z = projector(body(x)) and
ℓ_con = −log( e^{sim(z, z_glob)/τ} / (e^{sim(z, z_glob)/τ} + Σ_j e^{sim(z, z_prev_j)/τ}) ),
sim the cosine similarity, z_glob from the received global model and z_prev_j from the client's previous local
models (both frozen, in eval mode, as in the official code). It is computed as a cross-entropy over the
[positive, negatives] logits, which is the stable log-sum-exp form.

Choices, against the official code (``QinbinLi/MOON``):

* The projection head (``projection_layers`` linear layers with ReLUs between them, the last one to
  ``projection_dim``) is added by ``prepare_model`` and is exchanged and averaged with the rest of the model. The
  logits still come from ``head(body(x))``; the official ``ModelFedCon`` puts its classifier on the projection
  instead. Keeping the model's own head means every model in the zoo works unchanged and MOON with μ = 0 is
  exactly FedAvg (the projector then gets no gradient). ``projection_layers = 0`` contrasts the representations
  themselves, with no projector, as PFLlib's MOON does (the code base of FedRANE's baselines); with a wide
  representation (FedRANE's CNNModel: 1568) the official head would otherwise cost as much as the whole network.
* ``classifier = "projection"`` is the official architecture instead (``model.py::ModelFedCon``: the classifier
  ``l3`` is a Linear(projection_dim, C) on the projector's output, the vector that is contrasted): ``prepare_model``
  replaces the model's head with projector + that classifier, so the evaluated model is that network. It is the
  architecture MOON's own numbers came from; the default stays the side-branch projector above. Reproductions:
  FedRANE's Fashion-MNIST baselines use the default with ``projection_layers = 0`` (PFLlib's MOON); no
  reproduction config runs MOON's own tables.
* Previous models are client-held state: the client's last ``pool_size`` locally trained models (parameters and
  buffers), oldest first, replaced first-in first-out. The official pool instead snapshots every client's net
  after every round, so with partial participation a client's negatives there can be its untrained initial net
  or repeated stale copies; here they are always models the client actually trained.
* In a client's first participation there is no previous model, so the contrastive term is zero, as in the
  official code's first round (its pool is empty then).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Reply, Setup
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.algorithms.functional import Frozen

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer
    from fedhet.models.base import FedModel


class MoonConfig(FedAvgConfig):  # weighting "samples": the official code averages by data size
    # Official code default --mu 1; the paper's tuned best is 5 for CIFAR-10 (also the README's CIFAR-10 command)
    # and 1 for CIFAR-100 and Tiny-ImageNet (Li et al. 2021, Sec. 4.1).
    mu: float = Field(1.0, ge=0.0)
    temperature: float = Field(0.5, gt=0.0)  # τ = 0.5: paper and official --temperature default
    # Li et al. 2021 (MOON) Sec. 4.1: mu tuned in {0.1, 1, 5, 10}; their temperature study spans 0.1 to 1
    tunable: ClassVar[dict[str, str]] = {"mu": "log:0.1:10", "temperature": "uniform:0.1:1"}
    projection_dim: int = Field(256, ge=1)  # official --out_dim default 256
    # official ModelFedCon: Linear(f, f), ReLU, Linear(f, out_dim); 0: no projector (PFLlib), z = the representation
    projection_layers: int = Field(2, ge=0)
    pool_size: int = Field(1, ge=1)  # official --model_buffer_size default 1
    # "embedding": logits = the model's head on the representation, the projector a side branch (fedhet's reading;
    # PFLlib's MOON, with projection_layers = 0). "projection": official ModelFedCon, logits = Linear(projection_dim,
    # C) on the projector's output, the architecture of MOON's own results.
    classifier: Literal["embedding", "projection"] = "embedding"

    @model_validator(mode="after")
    def _projection_needs_a_projector(self) -> MoonConfig:
        if self.classifier == "projection" and self.projection_layers == 0:
            raise ValueError("classifier 'projection' needs projection_layers >= 1 (the official head has 2)")
        return self


class ProjectedHead(nn.Module):
    """The official ModelFedCon's head: the classifier reads the projection, ``classifier(projector(h))``."""

    def __init__(self, projector: nn.Module, classifier: nn.Linear) -> None:
        super().__init__()
        self.projector = projector
        self.classifier = classifier

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.projector(h))


def projection_head(in_dim: int, out_dim: int, layers: int) -> nn.Module:
    if layers == 0:
        return nn.Identity()
    modules: list[nn.Module] = []
    for _ in range(layers - 1):
        modules += [nn.Linear(in_dim, in_dim), nn.ReLU()]
    modules.append(nn.Linear(in_dim, out_dim))
    return nn.Sequential(*modules)


def moon_contrastive_loss(
    z: torch.Tensor, z_pos: torch.Tensor, z_negs: list[torch.Tensor], temperature: float
) -> torch.Tensor:
    """Mean over the batch of −log softmax([sim(z, z_pos), sim(z, z_neg_1), ...] / τ)[0]."""
    sims = [F.cosine_similarity(z, z_pos, dim=-1)] + [F.cosine_similarity(z, n, dim=-1) for n in z_negs]
    logits = torch.stack(sims, dim=1) / temperature
    labels = torch.zeros(len(z), dtype=torch.long, device=z.device)
    return F.cross_entropy(logits, labels)


@ALGORITHMS.register(
    "moon", "MOON (Li et al. 2021): model-contrastive loss against the global and previous local models", MoonConfig
)
class Moon(FedAvg):
    name = "moon"
    Config = MoonConfig
    # the previous models are per-client inputs, the global model an unbatched one (algorithms/functional.py);
    # clients with pools of different lengths are vmapped in separate sets
    batchable = True

    def __init__(self, config: MoonConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self._frozen: Frozen | None = None  # the architecture, run at the global and previous models' parameters

    @classmethod
    def prepare_model(cls, config: MoonConfig, model: FedModel) -> FedModel:
        projector = projection_head(model.embedding_dim, config.projection_dim, config.projection_layers)
        if config.classifier == "projection":
            classifier = nn.Linear(config.projection_dim, model.num_classes, bias=model.head.bias is not None)
            model.head = ProjectedHead(projector, classifier)
        else:
            model.projector = projector
        return model

    def projector(self, model: FedModel) -> nn.Module:
        return model.head.projector if self.config.classifier == "projection" else model.projector

    def contrasted(self, model: FedModel, x: torch.Tensor) -> torch.Tensor:
        return self.projector(model)(model.body(x))

    # ----------------------------------------------------------------- client side
    def before_local(self, ctx: ClientContext) -> None:
        prev = ctx.state.get("prev_params")
        ctx.scratch["moon_inputs"] = {}
        if self.config.mu == 0 or prev is None:  # first participation: no negatives, the term is zero
            return
        if self._frozen is None:
            self._frozen = Frozen(self.setup.build_model)
        ctx.scratch["moon_inputs"] = {
            "global": ctx.global_params,
            "global_buffers": ctx.message.tensors.get("buffers", torch.zeros(0)),
            "prev": prev,
            "prev_buffers": ctx.state["prev_buffers"],
        }

    def loss_inputs(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        return ctx.scratch["moon_inputs"]  # the pool as it was before this round's model joins it

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        embedding = model.body(x)
        if self.config.classifier == "projection":  # one pass: the classifier reads the contrasted projection
            z = model.head.projector(embedding)
            loss = F.cross_entropy(model.head.classifier(z), y)
        else:
            loss = F.cross_entropy(model.head(embedding), y)
            z = model.projector(embedding) if inputs else None
        if not inputs:
            return loss
        z_global = self._frozen(inputs["global"], inputs["global_buffers"], self.contrasted, x)
        z_prev = [
            self._frozen(p, b, self.contrasted, x) for p, b in zip(inputs["prev"], inputs["prev_buffers"], strict=True)
        ]
        return loss + self.config.mu * moon_contrastive_loss(z, z_global, z_prev, self.config.temperature)

    def after_local(self, ctx: ClientContext) -> Reply:
        reply = super().after_local(ctx)
        self.push_previous(ctx.state, ctx.flat.get_params(), ctx.flat.get_buffers())
        return reply

    def push_previous(self, state: dict[str, torch.Tensor], params: torch.Tensor, buffers: torch.Tensor) -> None:
        """Append this round's local model to the client's pool, keeping the newest ``pool_size``."""
        for key, vec in (("prev_params", params), ("prev_buffers", buffers)):
            old = state.get(key)
            pool = vec[None] if old is None else torch.cat([old, vec[None]])
            state[key] = pool[-self.config.pool_size :].clone()  # clone: a slice would keep the dropped rows alive
