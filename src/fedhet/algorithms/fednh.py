"""FedNH (Dai, Chen, Wang, Zhang and Lan, AAAI 2023, "Tackling Data Heterogeneity in Federated Learning with Class
Prototypes").

The classifier is a set of class prototypes P (one unit vector per class, no bias) and the logits are a scaled cosine:

    logits_c = s * <z / |z|, P_c / |P_c|>,      z = body(x)

Clients train the body and s with cross-entropy on these logits while P stays fixed ("uniformity": P starts as
random orthonormal rows). After local training a client computes, on its own training data and in eval mode, each
class's mean of normalised embeddings, normalises it, and uploads it multiplied by the class count n_kc, with the
counts. The server averages the bodies and s uniformly and moves each prototype towards the clients' estimate
("semantics"):

    m_c = normalize( sum_k n_kc normalize(mean_k,c) / sum_k n_kc )
    P_c <- normalize( rho P_c + (1 - rho) m_c )

A class that no replying client holds keeps its prototype exactly.

Where the prototypes live: ``prepare_model`` replaces the model's head (whatever its bias setting) with a
``PrototypeHead`` whose prototypes are a *buffer*, so they are not trainable parameters (no gradient, momentum or
weight decay can move them: frozen client-side, as the official client's ``requires_grad_(False)``), they travel in
the message's ``buffers`` tensor, the engine's evaluation and checkpoints (``global_buffers``) carry them, and any
FedModel works unchanged: ``forward`` is still ``head(body(x))``. A model built with a head bias (``cnn``'s
``head_bias`` defaults to true, lenet5/convnet/mlp always have one) simply loses it, since a prototype classifier
has none; the official Conv2CifarNH has none either. The reply adds ``proto_sums`` (C x D, the count-weighted
normalised class means) and ``class_counts`` (C).

Following the official code (``Yutong-Dai/FedNH``, src/flbase/strategies/FedNH.py, FedUH.py, models/CNN.py):

* Prototype initialisation: ``torch.nn.init.orthogonal_`` (``FedNH_head_init: orthogonal``), drawn from the global
  RNG, which the engine seeds from the run seed, so runs are deterministic. With C <= D the rows are orthonormal.
  With C > D ``orthogonal_`` gives orthonormal columns and rows of norm < 1, which the official model uses
  unnormalised until the first server update; here they are normalised at once (the method assumes unit
  prototypes). The official 2-D "uniform" init (evenly spaced angles, D = 2 only) is not offered.
* The scale s is a learnable parameter initialised to 1.0 (Conv2CifarNH; ResNetModNH uses 20.0), trained by the
  clients and averaged with the body (``FedNH_fix_scaling: False`` in the yaml configs). ``learn_scale = false``
  keeps it a constant (the official fixed value is 30).
* Body aggregation is the uniform mean of the replies (FedNHServer.aggregate: ``server_lr / num_participants``
  times the sum of updates); ``weighting = "samples"`` weights by data size instead. The step goes through the
  server optimiser, whose default (sgd, lr 1) is the official server_lr 1. Prototype estimates are always weighted
  by class counts, as officially.
* rho = ``FedNH_smoothing`` = 0.9 (main.py default and every yaml). rho = 1 never moves the prototypes (FedUH).

Differences:

* Classes nobody holds: officially their estimate is a zero row, and ``normalize(rho P_c)`` equals P_c up to
  rounding; here the row is left untouched, so it stays bit-identical.
* The official client estimates prototypes over its shuffled training loader; here over its training tensors in
  order, without augmentation, in chunks of ``EMBED_CHUNK`` (the sums differ only in float rounding).
* The confidence-weighted variants (``FedNH_client_adv_prototype_agg`` / ``FedNH_server_adv_prototype_agg``, off in
  every official experiment) are not implemented.
* The official client clips gradients at norm 10 (FedUHClient.training); here clipping is the shared
  ``train.grad_clip`` (set it to 10 to match).
* Personalised evaluation (the paper's "PM"): the official code tests each client's model right after its local
  training. ``personal_eval = true`` keeps the client's last trained parameters in its state and the engine reports
  their accuracy on the client's local test split. The engine loads the current global buffers with them, so they are
  evaluated with the current prototypes, not the ones they were trained against (rho = 0.9 moves them little per
  round); it costs one model per client in the state store, so it is off by default (FedACD uses the global model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Reply, Setup
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.toolkit.flat import FlatModel

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer
    from fedhet.models.base import FedModel

EMBED_CHUNK = 512  # samples per forward pass when a client estimates its class prototypes (bounds memory only)


class FedNHConfig(FedAvgConfig):
    # official FedNHServer.aggregate averages the bodies uniformly; "samples" weights clients by data size
    weighting: Literal["samples", "uniform"] = "uniform"
    # rho in P_c <- normalize(rho P_c + (1 - rho) m_c): official --FedNH_smoothing default 0.9 (main.py, yamls)
    smoothing: float = Field(0.9, ge=0.0, le=1.0)
    tunable: ClassVar[dict[str, str]] = {"smoothing": "uniform:0.5:0.99"}  # sensible default around rho = 0.9
    # initial logit scale s: 1.0 in the official Conv2CifarNH (ResNetModNH: 20.0; fixed scaling: 30.0)
    scale: float = Field(1.0, gt=0.0)
    # True: s is trained by clients and averaged (official FedNH_fix_scaling: False); False: s stays ``scale``
    learn_scale: bool = True
    # True: report personalised accuracy of each client's last locally trained model (official "PM" protocol);
    # costs one stored model per client (see the module docstring)
    personal_eval: bool = False


def init_prototypes(num_classes: int, dim: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Unit-norm prototypes, one row per class: random orthonormal rows (official ``orthogonal`` init) when
    num_classes <= dim; otherwise ``orthogonal_``'s rows, normalised."""
    w = torch.empty(num_classes, dim)
    nn.init.orthogonal_(w, generator=generator)
    return F.normalize(w, dim=1)


class PrototypeHead(nn.Module):
    """logits = s * cos(z, P_c): a bias-free cosine classifier whose prototypes are a buffer (never trained)."""

    fixed_buffers = True  # local training never changes the prototypes: batched clients share them

    def __init__(self, prototypes: torch.Tensor, scale: float, learn_scale: bool) -> None:
        super().__init__()
        self.register_buffer("prototypes", prototypes)
        # shape (1,) as the official ``scaling``; a constant scale is a plain float, so nothing averages it
        self.scale: nn.Parameter | float = nn.Parameter(torch.tensor([scale])) if learn_scale else scale

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.scale * (F.normalize(z, dim=1) @ F.normalize(self.prototypes, dim=1).T)


def class_prototype_sums(
    model: FedModel, x: torch.Tensor, y: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_c * normalize(mean of normalised embeddings of class c), n_c) for every class, in eval mode.

    Classes the client does not hold get a zero row and a zero count."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(num_classes, model.embedding_dim, device=y.device)
    with torch.no_grad():
        for start in range(0, len(y), EMBED_CHUNK):
            z = F.normalize(model.body(x[start : start + EMBED_CHUNK]), dim=1)
            sums.index_add_(0, y[start : start + EMBED_CHUNK], z)
    model.train(was_training)
    counts = torch.bincount(y, minlength=num_classes).to(sums.dtype)
    means = sums / counts.clamp(min=1.0)[:, None]
    return F.normalize(means, dim=1) * counts[:, None], counts


def update_prototypes(
    prototypes: torch.Tensor, sums: list[torch.Tensor], counts: list[torch.Tensor], rho: float
) -> torch.Tensor:
    """P_c <- normalize(rho P_c + (1 - rho) normalize(sum_k sums_kc / sum_k n_kc)) for the classes someone holds."""
    total = torch.stack(counts).sum(0)
    held = total > 0
    estimate = F.normalize(torch.stack(sums).sum(0) / total.clamp(min=1.0)[:, None], dim=1)
    moved = F.normalize(rho * prototypes + (1 - rho) * estimate, dim=1)
    return torch.where(held[:, None], moved, prototypes)


@ALGORITHMS.register(
    "fednh",
    "FedNH (Dai et al. 2023): cosine classifier on fixed class prototypes, smoothed server-side by class means",
    FedNHConfig,
)
class FedNH(FedAvg):
    name = "fednh"
    Config = FedNHConfig
    # the default loss; the prototypes are fixed buffers shared by a group, after_local reads the loaded row
    batchable = True
    weighted_aggregate = True  # aggregate runs FedAvg's, then replaces the prototypes (GNE applies)
    central_dp = False  # the prototype sums and class counts would reach the server unprivatised
    central_dp_unprivatised = "the class prototype sums and counts in the replies, computed from the clients' data"

    def __init__(self, config: FedNHConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self.personalized = config.personal_eval  # instance value: the engine asks the built algorithm
        self._layout: tuple[slice, slice | None] | None = None

    @classmethod
    def prepare_model(cls, config: FedNHConfig, model: FedModel) -> FedModel:
        prototypes = init_prototypes(model.num_classes, model.embedding_dim)
        model.head = PrototypeHead(prototypes, config.scale, config.learn_scale)
        return model

    def layout(self) -> tuple[slice, slice | None]:
        """Where the prototypes sit in the flat buffers, and s in the flat parameters (None when constant)."""
        if self._layout is None:
            with torch.random.fork_rng(devices=[]):  # building draws weights; the run's stream must not move
                flat = FlatModel(self.setup.build_model())
            offset, proto = 0, None
            for name, b in flat.model.named_buffers():
                if b.is_floating_point():
                    if name == "head.prototypes":
                        proto = slice(offset, offset + b.numel())
                    offset += b.numel()
            self._layout = (proto, flat.slices().get("head.scale"))
        return self._layout

    def prototypes(self) -> torch.Tensor:
        """The global prototypes (C x D), a view of the global buffers."""
        return self.global_buffers[self.layout()[0]].view(self.setup.num_classes, -1)

    # ----------------------------------------------------------------- server side
    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        old = self.prototypes().clone()
        super().aggregate(rnd, replies, phase)  # bodies and s; other buffers (BatchNorm statistics) averaged
        new = update_prototypes(
            old,
            [r.tensors["proto_sums"] for r in replies.values()],
            [r.tensors["class_counts"] for r in replies.values()],
            self.config.smoothing,
        )
        buffers = self.global_buffers.clone()  # the averaged copies of the prototypes are replaced
        buffers[self.layout()[0]] = new.reshape(-1)
        self.global_buffers = buffers
        return {}

    def round_metrics(self, rnd: int) -> dict[str, float]:
        p = self.prototypes()
        cos = p @ p.T - 2 * torch.eye(len(p), dtype=p.dtype, device=p.device)  # diagonal out of the max
        out = {"proto_max_cos": float(cos.max())}
        scale = self.layout()[1]
        if scale is not None:
            out["scale"] = float(self.global_params[scale][0])
        return out

    # ----------------------------------------------------------------- client side
    def after_local(self, ctx: ClientContext) -> Reply:
        reply = super().after_local(ctx)
        sums, counts = class_prototype_sums(ctx.model, ctx.data.x, ctx.data.y, ctx.data.num_classes)
        reply.tensors["proto_sums"] = sums
        reply.tensors["class_counts"] = counts
        if self.config.personal_eval:
            ctx.state["personal"] = reply.tensors["params"].clone()
        return reply

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        return ctx.state.get("personal")
