"""SphereFed (Dong, Zhang, Li and Kung, ECCV 2022, "SphereFed: Hyperspherical Federated Learning", arXiv
2207.09413).

The classifier is fixed: W (C x D) has orthonormal rows on the unit hypersphere and is never trained, and the
features are normalised to the sphere, so the logits are

    logits = W h,      h = z / |z|,  z = body(x).

Clients train the body only, against the same W, with the mean squared error to the one-hot label (``loss =
"mse"``: mean over the batch of |W h - e_y|^2) or cross-entropy on s W h (``loss = "ce"``). After training the
classifier is *calibrated* in closed form by least squares on the global model's normalised features of all
clients' training data,

    W*^T = (sum_k H_k^T H_k + lambda I)^(-1) sum_k H_k^T Y_k

(H_k: client k's features, one row each; Y_k: its one-hot labels), which needs only each client's D x D feature
Gram matrix and D x C feature-label sums, never its data or features.

How this fits the contract:

* The fixed classifier is a *buffer* of the replaced head (``SphereHead``, FedNH's pattern): no gradient,
  momentum or weight decay reaches it, it travels in ``buffers`` and is checkpointed with ``global_buffers``.
  ``prepare_model`` draws it with ``orthogonal_`` from the run-seeded global generator (as FedNH's prototypes; with
  C > D, rows of ``orthogonal_`` normalised, so no longer orthogonal). Any head bias is dropped.
* A round has two phases. ``train``: clients receive the body and the fixed W and train; the server averages the
  bodies (FedAvg, through the server optimiser). ``calibrate``: clients receive the new global body, compute their
  statistics in eval mode (no training, no augmentation) and the server solves for W*. W* replaces W in the
  evaluated global model (``global_buffers``, CReFF's pattern of an evaluated model that is not the broadcast one);
  the training messages always carry the fixed W, so W* never influences training. The paper calibrates once, after
  the last round; calibrating every round gives the same final model and lets every evaluation report it
  (``calibrate = false`` keeps the uncalibrated model and a single phase). The calibration uses the round's
  participants (all clients under FedRANE's full participation; the paper calibrates with every client).
* Personalised accuracy: SphereFed has no personal models. FedRANE reports it in its P-FL table with numbers that
  track its G-FL ones (PFLlib evaluates the clients' copies of the global model on their local test splits,
  sample-weighted); ``personalize`` returns the global model, so ``personal_acc_micro`` is that number.

Sources and deviations. No official code was found (the authors' code is not public; FedRANE's code base,
``XeniaLLL/HyperFed_and_FedRANE-master``, takes SphereFed's fixed classifier: rows of a QR-orthogonal matrix, no
bias, frozen, logits ``predictor(normalize(base(x)))``; its SphereFed client ``clientSphereG`` is missing from the
repository). The paper's full text is not in the reference corpus; the abstract states the fixed hyperspherical
classifier, the normalised features and the closed-form calibration "by minimizing a mean squared loss". Training
with the same squared loss (``loss = "mse"``) is the reading that makes calibration and training optimise one
objective; FedRANE's released client (``train_raw``) uses unscaled cross-entropy with its fixed classifier and
MSE in other variants, which ``loss = "ce"`` with ``ce_scale = 1`` reproduces. ``ridge`` only keeps the system
solvable when the features span fewer than D directions (the paper's solution is plain least squares).
``run.eval_local_models`` scores the bodies the clients trained in the ``train`` phase (``local_model_phase``), with
the fixed classifier they trained against; the calibration phase trains nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Message, Reply, Setup
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.algorithms.fednh import init_prototypes
from fedhet.toolkit.flat import FlatModel

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer
    from fedhet.models.base import FedModel

FEATURE_CHUNK = 512  # samples per forward pass when a client computes its statistics (bounds memory only)
TRAIN, CALIBRATE = "train", "calibrate"


class SphereFedConfig(FedAvgConfig):
    # "mse": mean over the batch of |W h - onehot(y)|^2, the squared loss the calibration minimises (paper's
    # abstract; see the module docstring); "ce": cross-entropy of ce_scale * W h (FedRANE's train_raw)
    loss: Literal["mse", "ce"] = "mse"
    ce_scale: float = Field(1.0, gt=0.0)  # logit scale for loss = "ce"; FedRANE's code uses none (1)
    # True: closed-form calibration of the classifier after every round's training (paper: after training)
    calibrate: bool = True
    # lambda added to the summed feature Gram matrix; only guards solvability (the paper's solution is plain
    # least squares), negligible next to the sample count
    ridge: float = Field(1e-3, ge=0.0)
    tunable: ClassVar[dict[str, str]] = {"ridge": "log:1e-5:1e-1"}  # sensible default: decades around 1e-3


class SphereHead(nn.Module):
    """logits = W (z / |z|): a bias-free linear classifier on normalised features whose weight is a buffer."""

    fixed_buffers = True  # local training never changes W: batched clients share it

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return F.normalize(z, dim=1) @ self.weight.T


def sphere_loss(logits: torch.Tensor, y: torch.Tensor, loss: str, ce_scale: float) -> torch.Tensor:
    if loss == "mse":  # the one-hot target as a comparison: F.one_hot checks the labels' values, which vmap cannot
        target = (y.unsqueeze(1) == torch.arange(logits.shape[1], device=y.device)).to(logits.dtype)
        return (logits - target).pow(2).sum(1).mean()
    return F.cross_entropy(ce_scale * logits, y)


def feature_statistics(
    model: FedModel, x: torch.Tensor, y: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(H^T H, H^T Y) of the normalised features H (eval mode) and one-hot labels Y of a client's data."""
    was_training = model.training
    model.eval()
    gram = torch.zeros(model.embedding_dim, model.embedding_dim, device=y.device)
    cross = torch.zeros(model.embedding_dim, num_classes, device=y.device)
    with torch.no_grad():
        for start in range(0, len(y), FEATURE_CHUNK):
            h = F.normalize(model.body(x[start : start + FEATURE_CHUNK]), dim=1)
            gram += h.T @ h
            cross.index_add_(1, y[start : start + FEATURE_CHUNK], h.T)
    model.train(was_training)
    return gram, cross


def calibrated_classifier(gram: torch.Tensor, cross: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_W sum |W h - y|^2 + ridge |W|^2 from the summed statistics: W = ((G + ridge I)^-1 X)^T, (C x D)."""
    g = gram.double() + ridge * torch.eye(len(gram), dtype=torch.float64, device=gram.device)
    return torch.linalg.solve(g, cross.double()).T.to(gram.dtype)


@ALGORITHMS.register(
    "spherefed",
    "SphereFed (Dong et al. 2022): fixed orthonormal classifier on normalised features + closed-form calibration",
    SphereFedConfig,
)
class SphereFed(FedAvg):
    name = "spherefed"
    Config = SphereFedConfig
    batchable = True  # its own loss; the fixed classifier is a buffer shared by a group
    loop_phases = (TRAIN,)  # the calibration's client_update computes statistics, sequentially
    personalized = True  # the global model on each client's local test split (FedRANE's P-FL column)

    def __init__(self, config: SphereFedConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self.phases = (TRAIN, CALIBRATE) if config.calibrate else (TRAIN,)  # instance value: the engine reads it
        self.fixed: torch.Tensor | None = None  # the fixed classifier (C x D), flattened
        self.stats: dict[str, float] = {}
        self._slice: slice | None = None

    @classmethod
    def prepare_model(cls, config: SphereFedConfig, model: FedModel) -> FedModel:
        model.head = SphereHead(init_prototypes(model.num_classes, model.embedding_dim))
        return model

    def classifier_slice(self) -> slice:
        """Where the classifier sits in the flat buffers."""
        if self._slice is None:
            with torch.random.fork_rng(devices=[]):  # building draws weights; the run's stream must not move
                model = FlatModel(self.setup.build_model()).model
            offset = 0
            for name, b in model.named_buffers():
                if not b.is_floating_point():
                    continue
                if name == "head.weight":
                    self._slice = slice(offset, offset + b.numel())
                offset += b.numel()
        return self._slice

    # ----------------------------------------------------------------- server side
    def init_server(self, params: torch.Tensor, buffers: torch.Tensor) -> None:
        super().init_server(params, buffers)
        self.fixed = self.global_buffers[self.classifier_slice()].clone()

    def with_classifier(self, weight: torch.Tensor) -> torch.Tensor:
        """A copy of the global buffers holding ``weight`` (flattened) as the classifier."""
        buffers = self.global_buffers.clone()
        buffers[self.classifier_slice()] = weight.reshape(-1)
        return buffers

    def configure(self, rnd: int, cids: list[int], phase: str) -> dict[int, Message]:
        msg = self.global_message(rnd)
        if phase == TRAIN:  # clients always train against the fixed classifier, never the calibrated one
            msg.tensors["buffers"] = self.with_classifier(self.fixed)
        return {cid: msg for cid in cids}

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        if phase == TRAIN:
            super().aggregate(rnd, replies, phase)  # bodies; other buffers (BatchNorm statistics) averaged
            self.global_buffers = self.with_classifier(self.fixed)  # not the averaged copies of it
            # the engine reads the training loss off the round's last phase, which is the calibration
            n = sum(r.num_examples for r in replies.values())
            self.stats = {"train_loss": sum(r.metrics["train_loss"] * r.num_examples for r in replies.values()) / n}
            return {}
        gram = torch.stack([r.tensors["gram"] for r in replies.values()]).sum(0)
        cross = torch.stack([r.tensors["cross"] for r in replies.values()]).sum(0)
        n = float(sum(r.num_examples for r in replies.values()))
        weight = calibrated_classifier(gram, cross, self.config.ridge)
        fixed = self.fixed.view_as(weight)
        self.stats |= {
            "calibration_mse_fixed": squared_error(fixed, gram, cross, n),
            "calibration_mse": squared_error(weight, gram, cross, n),
        }
        self.global_buffers = self.with_classifier(weight)
        return {}

    def round_metrics(self, rnd: int) -> dict[str, float]:
        return dict(self.stats)

    @property
    def local_model_phase(self) -> str:
        return TRAIN  # the calibration phase trains nothing: its replies are statistics of the global body

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fixed": self.fixed, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.fixed = state["fixed"]
        self.stats = {k: float(v) for k, v in state["stats"].items()}

    # ----------------------------------------------------------------- client side
    def client_update(self, ctx: ClientContext) -> Reply:
        if ctx.phase != CALIBRATE:
            return super().client_update(ctx)
        ctx.flat.set_params(ctx.global_params)
        if "buffers" in ctx.message.tensors:
            ctx.flat.set_buffers(ctx.message.tensors["buffers"])
        gram, cross = feature_statistics(ctx.model, ctx.data.x, ctx.data.y, ctx.data.num_classes)
        return Reply(tensors={"gram": gram, "cross": cross}, num_examples=len(ctx.data))

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sphere_loss(model(x), y, self.config.loss, self.config.ce_scale)

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        return ctx.global_params  # evaluated with the message's buffers: the calibrated classifier


def squared_error(weight: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor, n: float) -> float:
    """mean |W h - y|^2 over the samples behind the statistics: (tr(W G W^T) - 2 tr(W X) + n) / n."""
    w = weight.double()
    total = (w @ gram.double() * w).sum() - 2 * (w * cross.double().T).sum() + n
    return float(total / max(n, 1.0))
