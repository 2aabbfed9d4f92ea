"""CReFF (Shang, Lu, Huang, Wang, IJCAI 2022, "Federated Learning on Heterogeneous and Long-Tailed Data via
Classifier Re-Training with Federated Features"); official code shangxinyi/CReFF-FL, ``main.py``.

Clients train exactly as in FedAvg (plain cross-entropy), so their models are FedAvg's bit for bit. Before local
training each client also computes, for every class c it holds, the gradient of the mean cross-entropy with respect
to the classifier (``head``) on real features of class c: the features are the received model's body output (eval
mode), the classifier is the server's re-trained head sent with the message (``creff_head``). As in the official
``Local.compute_gradient``, the gradient is averaged over ``real_repeats`` batches of at most ``batch_real`` samples
of the class drawn without replacement. The client replies with its model plus these per-class gradients.

The server keeps ``num_features`` learnable federated features per class (standard normal at the start). Each
round it averages the models (FedAvg, through the server optimiser), averages each class's real gradients over the
clients that hold the class, and takes ``match_epochs`` plain SGD steps (``lr_feature``) on the features to minimise

    sum_c  D(grad_head CE(head(F_c), c), g_c),   D(G, G') = sum over layers, rows i of 1 - cos(G_i, G'_i)

(the official ``match_loss`` with ``dis_metric = 'ours'``: the weight matrix row by row, the bias as one row; the
cosine's denominator has + 1e-6) over the classes that some client reported this round, at the head the clients used.
It then re-trains a freshly initialised linear classifier on all features (``retrain_epochs`` epochs of plain SGD at
``lr_retrain``, shuffled mini-batches of the clients' batch size, as the official ``feature_re_train``).

What is reported and what is sent: the evaluated global model (``global_params``, what the engine evaluates and
checkpoints) is the FedAvg body with the re-trained head; the clients receive the plain FedAvg model
(``broadcast_params``) for local training and the re-trained head only for their gradient computation, as in the
official loop (``syn_model`` is reloaded with ``fedavg_params`` after evaluation; ``syn_feature_params`` is the
FedAvg model with the re-trained classifier) and in Yutong-Dai/FedNH ``strategies/CReFF.py``. No engine change is
needed: the algorithm keeps the two vectors apart and overrides ``global_message``.

Where this differs from the official code, and why:

* The head gradient is computed in closed form, ((softmax - onehot)^T F / n, mean(softmax - onehot)), the gradient
  autograd gives for a linear layer under mean cross-entropy; the server differentiates through it for the
  features. The classes are matched in one batched computation (the loss is the same sum over classes).
* Sampling and augmentation of the real batches draw from their own stream, derived from the client's seed, so the
  client's generator (batch order, augmentation) and the model are untouched and local training is FedAvg's. The
  official code augments these batches with DSA (``color_crop_cutout_flip_scale_rotate``, seeded from the clock),
  which fedhet has not; ``augment_real`` applies the run's own augmentation (``train.augment``), none by default.
* In round 1 the clients' gradients are taken at the initial model's head (the official code uses a separate
  randomly initialised linear layer; both are random).
* The server's random streams (initial features, each round's head initialisation and shuffling) derive from one
  seed drawn, without consuming it, from the global torch generator when the server is built; ``build_training``
  seeds that generator from ``run.seed``, so they are reproducible per run seed and resume bit for bit.
* The official server aggregates each class's gradients uniformly over the clients holding it (``grad_weighting =
  "uniform"``: clients send only which classes they hold, keeping their class counts private as the paper
  stresses); ``"class_counts"`` weights each client by its number of samples of the class, which makes the
  aggregate the gradient over all real samples of the class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Message, Reply, Setup, weighted_sum
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.data.device import to_device
from fedhet.toolkit.flat import FlatModel

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer


class CReFFConfig(FedAvgConfig):
    num_features: int = Field(100, ge=1)  # federated features per class; options.py num_of_feature = 100
    match_epochs: int = Field(100, ge=0)  # SGD steps on the features per round; options.py match_epoch = 100
    lr_feature: float = Field(0.1, gt=0.0)  # options.py lr_feature = 0.1 (plain SGD, main.py optimizer_feature)
    retrain_epochs: int = Field(300, ge=1)  # epochs over the features per round; options.py crt_epoch = 300
    lr_retrain: float = Field(0.01, gt=0.0)  # options.py lr_net = 0.01 (plain SGD, main.py feature_re_train)
    # sensible defaults: a decade either side of the official lr_feature 0.1 and lr_net 0.01
    tunable: ClassVar[dict[str, str]] = {"lr_feature": "log:1e-2:1", "lr_retrain": "log:1e-3:1e-1"}
    # main.py feature_re_train batches the features by batch_size_local_training (the clients' batch size, 32 in
    # options.py); None uses train.batch_size likewise
    retrain_batch_size: int | None = Field(None, ge=1)
    # "random": a freshly initialised linear classifier every round (main.py feature_re_train, nn.Linear's init);
    # "fedavg": start from the averaged head (the paper does not say; not in the official code)
    retrain_init: Literal["random", "fedavg"] = "random"
    batch_real: int = Field(32, ge=1)  # real samples per class and batch; options.py batch_real = 32
    real_repeats: int = Field(10, ge=1)  # batches averaged per class; main.py compute_gradient "repeat 10 times"
    # The official code augments the real batches with DSA; fedhet applies train.augment when True (module doc).
    augment_real: bool = True
    # "uniform": mean over the clients holding the class (main.py update_feature_syn); "class_counts": weighted by
    # each client's sample count of the class (the clients then reveal their counts)
    grad_weighting: Literal["uniform", "class_counts"] = "uniform"


@dataclass(frozen=True)
class HeadLayout:
    """Where the linear head lives in the flat parameter vector, and its shape."""

    weight: slice
    bias: slice | None
    num_classes: int
    dim: int

    @classmethod
    def of(cls, flat: FlatModel) -> HeadLayout:
        slices, head = flat.slices(), flat.model.head
        return cls(slices["head.weight"], slices.get("head.bias"), head.out_features, head.in_features)

    @property
    def size(self) -> int:
        return self.num_classes * self.dim + (self.num_classes if self.bias is not None else 0)

    def take(self, params: torch.Tensor) -> torch.Tensor:
        """The head of a flat parameter vector as one vector [weight, bias]."""
        parts = [params[self.weight]] + ([params[self.bias]] if self.bias is not None else [])
        return torch.cat(parts)

    def put(self, params: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """A copy of ``params`` with its head replaced by ``head`` ([weight, bias])."""
        out = params.clone()
        weight, bias = self.split(head)
        out[self.weight] = weight.reshape(-1)
        if bias is not None:
            out[self.bias] = bias
        return out

    def split(self, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[weight, bias] vectors (..., size) as weights (..., C, D) and biases (..., C) (None without a bias)."""
        n = self.num_classes * self.dim
        weight = head[..., :n].reshape(*head.shape[:-1], self.num_classes, self.dim)
        return weight, (head[..., n:] if self.bias is not None else None)

    @staticmethod
    def join(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The inverse of ``split``."""
        flat = weight.reshape(*weight.shape[:-2], -1)
        return flat if bias is None else torch.cat([flat, bias], -1)


def head_grads(
    features: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradient of the mean cross-entropy of ``features @ weight.T + bias`` w.r.t. weight and bias.

    ``features`` is (..., n, D) and ``labels`` (..., n): leading dimensions are independent problems."""
    logits = features @ weight.T
    if bias is not None:
        logits = logits + bias
    err = logits.softmax(-1) - F.one_hot(labels, weight.shape[0]).to(logits.dtype)
    g_weight = err.transpose(-1, -2) @ features / features.shape[-2]
    return g_weight, (err.mean(-2) if bias is not None else None)


def match_distance(syn: list[torch.Tensor], real: list[torch.Tensor]) -> torch.Tensor:
    """The official ``match_loss`` ('ours'): summed over layers and their output rows, 1 - cos(syn row, real row).

    Each layer is (..., rows, cols): a weight's rows are its outputs, a bias is one row (``as_rows``). The cosine's
    denominator has + 1e-6 as in ``distance_wb``. The result keeps the leading dimensions."""
    total = torch.zeros(())
    for s, r in zip(syn, real, strict=True):
        cos = (s * r).sum(-1) / (s.norm(dim=-1) * r.norm(dim=-1) + 1e-6)
        total = total + (1 - cos).sum(-1)
    return total


def as_rows(weight: torch.Tensor, bias: torch.Tensor | None) -> list[torch.Tensor]:
    """A head gradient as the layers ``match_distance`` compares: the weight's rows, the bias as one row."""
    return [weight] if bias is None else [weight, bias.unsqueeze(-2)]


def stream(seed: int, *tags: int) -> torch.Generator:
    """An independent generator for (seed, tags)."""
    state = np.random.SeedSequence([int(seed), *tags]).generate_state(1, np.uint64)[0] >> 1
    return torch.Generator().manual_seed(int(state))


REAL_STREAM, ROUND_STREAM, FEATURE_STREAM = 0xC3EF, 0x5E4F, 0xFEA7


@ALGORITHMS.register(
    "creff",
    "CReFF (Shang et al. 2022): FedAvg + classifier re-trained on server-side federated features",
    CReFFConfig,
)
class CReFF(FedAvg):
    name = "creff"
    head_refusal = "re-trains the head on the server from federated features, so the head must train"
    Config = CReFFConfig
    unbatchable_reason = "after_local computes per-class gradients of the trained model through ctx.model"

    def __init__(self, config: CReFFConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        self.broadcast_params: torch.Tensor | None = None  # the FedAvg model the clients train from
        self.head: torch.Tensor | None = None  # the re-trained head [weight, bias]
        self.features: torch.Tensor | None = None  # (C * num_features, D) federated features, class-major
        self.seed = 0
        self.stats: dict[str, float] = {}
        self._layout: HeadLayout | None = None

    @property
    def layout(self) -> HeadLayout:
        if self._layout is None:
            with torch.random.fork_rng(devices=[]):  # building must not shift any random stream
                self._layout = HeadLayout.of(FlatModel(self.setup.build_model()))
        return self._layout

    # ----------------------------------------------------------------- server side
    def init_server(self, params: torch.Tensor, buffers: torch.Tensor) -> None:
        super().init_server(params, buffers)
        self.broadcast_params = self.global_params.clone()
        self.head = self.layout.take(self.global_params)
        with torch.random.fork_rng(devices=[]):  # read the run-seeded global generator without advancing it
            self.seed = int(torch.randint(0, 2**62, (1,)))
        lay = self.layout
        shape = (lay.num_classes * self.config.num_features, lay.dim)
        self.features = torch.randn(shape, generator=stream(self.seed, FEATURE_STREAM)).to(params.device)

    def global_message(self, rnd: int) -> Message:
        msg = super().global_message(rnd)
        msg.tensors["params"] = self.broadcast_params
        msg.tensors["creff_head"] = self.head
        return msg

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        weights = self.aggregation_weights(replies)
        target = weighted_sum([r.tensors["params"] for r in replies.values()], weights)
        self.broadcast_params = self.server_opt.step(self.broadcast_params, target)
        self.average_buffers(replies, weights)
        real, held = self.aggregate_class_grads(replies)
        self.stats = {"creff_match_loss": self.match_features(real, held)}
        gen = stream(self.seed, ROUND_STREAM, rnd)
        self.head, self.stats["creff_retrain_loss"] = self.retrain_head(gen)
        self.global_params = self.layout.put(self.broadcast_params, self.head)
        return {}

    def aggregate_class_grads(self, replies: dict[int, Reply]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each class's average real head gradient (C, head size) and which classes some client reported."""
        grads = torch.stack([r.tensors["creff_grads"] for r in replies.values()])  # (K, C, P)
        weights = torch.stack([r.tensors["creff_weight"] for r in replies.values()])  # (K, C)
        total = weights.sum(0)
        held = total > 0
        mean = (weights.unsqueeze(-1) * grads).sum(0) / total.clamp_min(1e-12).unsqueeze(-1)
        return mean, held

    def class_blocks(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Features as (C, M, D) with their labels (C, M)."""
        c, m = self.layout.num_classes, self.config.num_features
        labels = torch.arange(c, device=features.device).repeat_interleave(m).view(c, m)
        return features.view(c, m, -1), labels

    def match_features(self, real: torch.Tensor, held: torch.Tensor) -> float:
        """``match_epochs`` SGD steps on the features of the held classes; returns the last distance."""
        if not bool(held.any()) or self.config.match_epochs == 0:
            return 0.0
        weight, bias = self.layout.split(self.head)
        target = as_rows(*self.layout.split(real[held]))
        feats, loss = self.features.clone(), torch.zeros(())
        for _ in range(self.config.match_epochs):
            feats.requires_grad_(True)
            blocks, labels = self.class_blocks(feats)
            syn = as_rows(*head_grads(blocks[held], labels[held], weight, bias))
            loss = match_distance(syn, target).sum()
            (grad,) = torch.autograd.grad(loss, feats)
            feats = (feats - self.config.lr_feature * grad).detach()
        self.features = feats
        return float(loss.detach())

    def retrain_head(self, gen: torch.Generator) -> tuple[torch.Tensor, float]:
        """A linear classifier trained on the federated features by plain SGD; returns it and its final loss."""
        lay, cfg = self.layout, self.config
        if cfg.retrain_init == "random":  # nn.Linear's default: U(-1/sqrt(D), 1/sqrt(D)) for weight and bias
            head = ((torch.rand(lay.size, generator=gen) * 2 - 1) * lay.dim**-0.5).to(self.features.device)
        else:
            head = lay.take(self.broadcast_params)
        weight, bias = lay.split(head)
        x, y = self.features, self.class_blocks(self.features)[1].reshape(-1)
        size = cfg.retrain_batch_size or self.setup.train.batch_size
        for _ in range(cfg.retrain_epochs):
            perm = to_device(torch.randperm(len(y), generator=gen), x.device)
            xs, ys = x[perm], y[perm]  # one shuffle per epoch, batches are views
            for start in range(0, len(y), size):
                g_w, g_b = head_grads(xs[start : start + size], ys[start : start + size], weight, bias)
                weight = weight - cfg.lr_retrain * g_w
                if bias is not None:
                    bias = bias - cfg.lr_retrain * g_b
        logits = x @ weight.T if bias is None else x @ weight.T + bias
        return lay.join(weight, bias), float(F.cross_entropy(logits, y))

    def round_metrics(self, rnd: int) -> dict[str, float]:
        return dict(self.stats)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "broadcast_params": self.broadcast_params,
            "head": self.head,
            "features": self.features,
            "seed": self.seed,
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.broadcast_params = state["broadcast_params"]
        self.head = state["head"]
        self.features = state["features"]
        self.seed = int(state["seed"])
        self.stats = {k: float(v) for k, v in state["stats"].items()}

    # ----------------------------------------------------------------- client side
    def before_local(self, ctx: ClientContext) -> None:
        ctx.scratch["creff"] = self.real_class_grads(ctx)

    def real_class_grads(self, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Per class held: the head gradient on real features, averaged over ``real_repeats`` sampled batches.

        Returns (C, head size) gradients (zero rows for absent classes) and the class weights the server uses."""
        cfg, lay = self.config, HeadLayout.of(ctx.flat)
        weight, bias = lay.split(ctx.message.tensors["creff_head"])
        counts = ctx.data.label_counts()
        classes = [int(c) for c in torch.nonzero(counts).flatten()]
        members = {c: torch.nonzero(ctx.data.y == c).flatten() for c in classes}
        gen = stream(ctx.generator.initial_seed(), REAL_STREAM)  # never the client's own stream
        out = torch.zeros(lay.num_classes, lay.size, device=weight.device)
        training = ctx.model.training
        ctx.model.eval()  # as main.py compute_gradient: no dropout, no running-statistics update
        try:
            with torch.no_grad():
                for _ in range(cfg.real_repeats):
                    idx = self.sample(members, classes, gen)
                    x, y = ctx.data.x[idx], ctx.data.y[idx]
                    if cfg.augment_real and ctx.augment is not None:
                        x = ctx.augment(x, gen)
                    feats = ctx.model.body(x)  # the head's input (FedModel: forward = head(body(x)))
                    for c in classes:
                        mask = y == c
                        out[c] += lay.join(*head_grads(feats[mask], y[mask], weight, bias))
        finally:
            ctx.model.train(training)
        out /= cfg.real_repeats
        class_weight = counts if cfg.grad_weighting == "class_counts" else (counts > 0).to(counts.dtype)
        return out, class_weight

    def sample(self, members: dict[int, torch.Tensor], classes: list[int], gen: torch.Generator) -> torch.Tensor:
        """One batch: at most ``batch_real`` samples of each class, without replacement."""
        n = self.config.batch_real
        return torch.cat([members[c][torch.randperm(len(members[c]), generator=gen)[:n]] for c in classes])

    def after_local(self, ctx: ClientContext) -> Reply:
        reply = super().after_local(ctx)
        grads, class_weight = ctx.scratch["creff"]
        reply.tensors["creff_grads"] = grads
        reply.tensors["creff_weight"] = class_weight
        return reply
