"""FedUFO (Zhang, Luo, Bai, Du and Duan, ICCV 2021, "Federated Learning for Non-IID Data via Unified Feature
Learning and Optimization Objective Alignment"), its stage one FedUAD, and the ablations of its Tables 3-5.

A round has two exchanges (the engine's phases). In phase ``prior`` each sampled client k trains a prior model
w~_k from the global model w_t with plain cross-entropy and replies with it and its label counts n_k. The server
relays the group's priors and the class proportions

    p_j[c] = n_{j,c} / sum_{j' in S_t} n_{j',c}          (0 for a class no member holds; sum_j p_j[c] = 1 otherwise)

to every member, and in phase ``posterior`` each client trains the posterior model w_k (from w_t) with

    L = CE + L_uad + L_cgr + lambda L_cgl                                  (Eq. 12; stage one: CE + L_uad, Eq. 11)
    L_uad = -(1/K) sum_{j=1..K} log softmax(D(f^))_j                      (Eq. 4, uniform target over all K clients)
    L_cgr = KL(y~ || y^),  y~ = softmax(sum_{j in S_t} p_j * softmax(h(x | w~_j)))   (Eq. 6-8, * elementwise)
    L_cgl = KL(y~_0 || y^), y~_0 = softmax(h(x | w_t))                     (Eq. 9-10)

where f^ = h_e(x | w_k) is the posterior's embedding and y^ its prediction. D is the client-ID discriminator
(``models/discriminator.py``, K = every client of the federation, two FC layers with ReLU), attached to the model
by ``prepare_federated_model``. While the model trains D is frozen (gradients flow through it into h_e, D itself
does not move); afterwards the model is frozen and D trains for ``disc_epochs`` epochs on (Eq. 5)

    L_d = CE(D(f^), l_k) + 1/(|S_t| - 1) sum_{j in S_t, j != k} CE(D(h_e(x | w~_j)), l_j)

with l_j the global id of client j. The server averages the posteriors (D included) with FedAvg's weights.
Stage one is rounds 1..``stage1_rounds`` (CE + UAD; the model at its end is FedUAD); stage two adds CGR and CGL.
A configuration with neither UAD nor CGR needs no priors and runs one phase named ``train``, so ``fedufo_cls``
(CE only) is FedAvg bit for bit and ``fedufo_cgl`` is FedAvg plus distillation from w_t.

Relay: the server stacks the group's priors once into one (|S_t|, P) tensor of the phase-B message, which every
member shares (read-only in the simulation; over Flower it travels as a message like any other). Clients run the
priors and w_t as teachers through ``torch.func.functional_call`` on views of the message rows, in eval mode and
without gradient, so no client copies a relayed model.

Sources: the paper and notes/fedufo.md, whose proposed readings (sec. 2.5) are the defaults below; no official
code exists (the repositories named FedUFO on GitHub are unrelated, notes sec. 1). Choices where the paper is silent:

* the posterior starts from w_t (2.5.1; ``posterior_init = "prior"`` continues from the client's own prior);
  prior and posterior use the same optimiser and local epochs (2.5.2; ``prior_epochs`` sets the prior's);
* D is a federated component averaged with the model (2.5.3; ``discriminator = "private"`` keeps one per client as
  client state, as FedRoD's personal head; the notes' third reading, a server-held D, is not offered since nothing
  would train it); ``disc_mode`` (below) offers two readings in which D never carries over; it keeps training in
  stage two (2.5.5, ``disc_in_stage_two``); it trains after the model in each round for ``disc_epochs`` = 1 epoch
  with the loop's optimiser (``train.optimizer`` and its settings, its state fresh every round) and the round's lr
  but no gradient clipping (2.5.4), on features computed once per round in eval mode (the model is frozen then, so
  they are constants);
  ``disc_schedule = "step"`` alternates per mini-batch instead (one D step on each batch right after the model's
  step, same optimiser settings), so D follows the features within the round;
* KL(teacher || student) with batchmean reduction and no temperature (2.5.7; PyTorch's ``kl_div(log y^, y~)``);
* the CGR target is the literal softmax of the mixture (2.5.8; ``cgr_fusion = "l1"`` normalises it instead) and
  includes the client's own prior (2.5.9, Eq. 6-7 range over j = 1..K_c; ``cgr_include_self = false`` fuses the
  others only, with proportions over them, as the text's "all the other clients");
* only the clients whose prior came back form the group and train a posterior; a client dropped in phase A is
  dropped for the round;
* without augmentation the consensus targets of all local samples are computed once per round and looked up by the
  batch's indices (``ctx.batch``; notes 8.14); with augmentation they are computed for every mini-batch;
* the stage lengths are not given (2.5.6): ``stage1_rounds`` = 50 is ours (Fig. 3 shows the CGL variants, "all"
  included, apart from FedAvg within the first 100 MNIST rounds, so stage one is shorter); stage two is the rest.

``disc_mode`` says what D is from round to round (docs/reproductions/fedufo.md has the evidence):

* ``"federated"`` (default, the paper-literal reading above): D is averaged with the model and carried across rounds,
  so each round's UAD loss pushes the features against the D that all earlier rounds trained;
* ``"fresh"``: a new D per client per round, trained after the model and never reused (the literal reading of the
  paper's per-round, per-client w^d_{t,k}, and what public unofficial reimplementations do). At the start of every
  round's phase B the client's D is a fresh initialisation (``ClientDiscriminator``'s own init, torch's default for
  ``nn.Linear``) drawn from the client's seed of that round (``fresh_disc_seed``); the model trains against it,
  then it trains on Eq. 5 (its loss is reported), and it is dropped: the reply carries the global D back and the
  server keeps its D as it is. So the UAD loss always reads an untrained D;
* ``"frozen"``: D is never trained (every round reads the initial D; the server's D stays bit for bit as it was).
  With ``disc_epochs = 0`` the federated reading behaves the same up to the float rounding of the average.

Presets (Tables 1, 3-5, all without dynamic sampling, which is the engine's client sampler): ``fedufo`` (= "all",
two stages), ``feduad`` (= "+uad": CE + UAD in every round), ``fedufo_cls`` (= FedAvg), ``fedufo_cgr``,
``fedufo_cgl`` (single stage, notes 2.5.6), ``fedufo_uad_cgr``, ``fedufo_uad_cgl`` (two stages, as "all").
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn
from torch.func import functional_call

from fedhet.algorithms.base import ALGORITHMS, ClientContext, Message, Reply, Setup, weighted_sum
from fedhet.algorithms.fedavg import FedAvg, FedAvgConfig
from fedhet.models.discriminator import ClientDiscriminator
from fedhet.toolkit.flat import FlatModel
from fedhet.toolkit.local import FlatOptimizer, batch_indices, derive_seed, local_optimizer, num_local_steps

if TYPE_CHECKING:
    from fedhet.algorithms.server_opt import ServerOptimizer
    from fedhet.models.base import FedModel

DISC = "discriminator"  # the attribute prepare_federated_model attaches; its parameters come last in the flat vector
PROB_FLOOR = 1e-12  # reverse KL takes log of the target: an l1-fused class absent from the group would be log 0
CHUNK = 1024  # samples per teacher pass over a client's data (bounds the memory of a large client)
FRESH_DISC_TAG = 0xD15C  # disc_mode "fresh": the stream a fresh D is drawn from, apart from the client's own streams


class FedUFOConfig(FedAvgConfig):  # weighting "samples": "weighted aggregation" as FedAvg (notes 2.5.13)
    uad: bool = True  # UAD loss and the discriminator (Sec. 3.2); false in the ablations without "uad"
    cgr: bool = True  # group consensus loss (Sec. 3.3.1), stage two only; needs the relayed priors
    cgl: bool = True  # global consensus loss (Sec. 3.3.2), stage two only
    # rounds of stage one (CE + UAD only); not given in the paper (notes 2.5.6), 50 is our proposal
    stage1_rounds: int = Field(50, ge=0)
    cgl_weight: float = Field(3.0, ge=0.0)  # lambda of Eq. 12: 3 on every dataset (Sec. 4.1.1, Fig. 4)
    # Fig. 4 (notes/fedufo.md): lambda = 1, 2, 3 alike, 3 best, above 3 slower or stalled
    tunable: ClassVar[dict[str, str]] = {"cgl_weight": "uniform:0.5:5"}
    cgr_weight: float = Field(1.0, ge=0.0)  # Eq. 12: unweighted
    uad_weight: float = Field(1.0, ge=0.0)  # Eq. 11-12: unweighted
    # local epochs of the prior; None: train.local_epochs, the proposal of notes 2.5.2 (the paper gives one E = 10).
    # Applies when train.local_steps is unset.
    prior_epochs: float | None = Field(None, gt=0.0)
    # proposal, notes 2.5.1 ("global" makes cls exactly FedAvg, as the paper states); "prior": the own prior model
    posterior_init: Literal["global", "prior"] = "global"
    # proposal, notes 2.5.3: D sent and averaged with the model; "private": each client keeps its own D
    discriminator: Literal["federated", "private"] = "federated"
    disc_layers: int = Field(2, ge=1)  # Sec. 4.1.1: two FC layers with ReLU (three for re-ID and CUB, Sec. 4.3)
    disc_hidden: int | None = Field(None, ge=1)  # None: the embedding size (Sec. 4.1.1: "same as the input")
    disc_epochs: int = Field(1, ge=0)  # E_d, proposal of notes 2.5.4; the paper does not say
    disc_in_stage_two: bool = True  # proposal, notes 2.5.5: D keeps training in stage two; false: frozen there
    # proposal, notes 2.5.4: "round" trains the model for its local epochs with D frozen, then D for disc_epochs
    # epochs with the model frozen; "step" is the notes' alternative, GAN-style alternation per mini-batch: after
    # every model step, one step of D on that batch's features (disc_epochs unused)
    disc_schedule: Literal["round", "step"] = "round"
    # proposal, notes 2.5.9: the client's own prior is in the CGR fusion (Eq. 6-7 range over j = 1..K_c); false:
    # "the local models of all the other clients" (the text), with the proportions taken over those clients
    cgr_include_self: bool = True
    # proposal, notes 2.5.8: "softmax" is Eq. 7 literally; "l1" divides the mixture by its sum (a deviation)
    cgr_fusion: Literal["softmax", "l1"] = "softmax"
    # proposal, notes 2.5.7: "forward" = KL(teacher || student) (PyTorch's KLDivLoss), "reverse" = KL(student || t.)
    kl_direction: Literal["forward", "reverse"] = "forward"
    # proposal, notes 2.5.7: "batchmean" sums over classes and averages over samples; "mean" also divides by C
    kl_reduction: Literal["batchmean", "mean"] = "batchmean"
    # what D is from round to round (docs/reproductions/fedufo.md, "Discriminator readings"). "federated"
    # (paper-literal, default): averaged with the model and carried across rounds; "fresh": a new D per client per
    # round (fresh init from the client's round seed), trained after the model and never reused; "frozen": never
    # trained, the initial D in every round
    disc_mode: Literal["federated", "fresh", "frozen"] = "federated"

    @model_validator(mode="after")
    def _prior_init_needs_priors(self) -> FedUFOConfig:
        if self.posterior_init == "prior" and not (self.uad or self.cgr):
            raise ValueError("posterior_init='prior' needs the prior phase, i.e. uad=true or cgr=true")
        if self.disc_mode != "federated" and not self.uad:
            raise ValueError(f"disc_mode={self.disc_mode!r} needs the discriminator, i.e. uad=true")
        if self.disc_mode != "federated" and self.discriminator == "private":
            raise ValueError(f"disc_mode={self.disc_mode!r} keeps no D across rounds: use discriminator='federated'")
        return self


def class_proportions(counts: torch.Tensor) -> torch.Tensor:
    """p_j[c] = n_{j,c} / sum_j' n_{j',c} for the group's (G, C) label counts; 0 where no member holds class c."""
    total = counts.sum(0, keepdim=True)
    return torch.where(total > 0, counts / total.clamp_min(1.0), torch.zeros_like(counts))


def fuse_group(probs: torch.Tensor, proportions: torch.Tensor, fusion: str) -> torch.Tensor:
    """Eq. 7: softmax(sum_j p_j * y~_j) for (G, B, C) predictions and (G, C) proportions ("l1": m / sum m)."""
    mixture = (proportions[:, None, :] * probs).sum(0)
    if fusion == "softmax":
        return F.softmax(mixture, dim=1)
    return mixture / mixture.sum(1, keepdim=True)


def kl_to_target(logits: torch.Tensor, target: torch.Tensor, direction: str, reduction: str) -> torch.Tensor:
    """KL(target || softmax(logits)) ("forward") or KL(softmax(logits) || target) ("reverse"); target detached."""
    log_p = F.log_softmax(logits, dim=1)
    if direction == "forward":
        pointwise = torch.xlogy(target, target) - target * log_p
    else:
        pointwise = log_p.exp() * (log_p - target.clamp_min(PROB_FLOOR).log())
    return pointwise.sum() / len(logits) if reduction == "batchmean" else pointwise.mean()


def uniform_loss(disc_logits: torch.Tensor) -> torch.Tensor:
    """Eq. 4 averaged over the batch: cross-entropy of D's prediction against the uniform distribution."""
    return -F.log_softmax(disc_logits, dim=1).mean(1).mean()


def discriminator_loss(
    disc: nn.Module, own: torch.Tensor, own_id: int, others: list[tuple[torch.Tensor, int]]
) -> torch.Tensor:
    """Eq. 5: the posterior's features labelled with the client's own id, the other members' prior features with
    theirs, averaged over the other members (mean over the batch in both terms)."""
    features = torch.stack([own] + [f for f, _ in others])  # (M, B, F): one forward of D for every member
    ids = torch.tensor([own_id] + [cid for _, cid in others], device=own.device)
    m, b = features.shape[:2]
    logits = disc(features.flatten(0, 1))
    ce = F.cross_entropy(logits, ids.repeat_interleave(b), reduction="none").view(m, b).mean(1)
    return ce[0] + ce[1:].sum() / (m - 1) if m > 1 else ce[0]


def fresh_disc_seed(client_seed: int) -> int:
    """disc_mode "fresh": the seed of the D a client draws in a round, from that client's seed of the round (the
    engine's derive_seed(run seed, round, client, phase), ``ctx.generator.initial_seed()``)."""
    return derive_seed(client_seed, FRESH_DISC_TAG)


def fresh_discriminator(
    seed: int, in_dim: int, num_clients: int, hidden: int | None, layers: int, device: torch.device | None = None
) -> torch.Tensor:
    """The flat parameters of a ClientDiscriminator initialised from ``seed`` (its parameters' order, which is the
    order of D's slice of the flat vector). The global torch stream is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        disc = ClientDiscriminator(in_dim, num_clients, hidden, layers)
    return torch.cat([p.detach().reshape(-1) for p in disc.parameters()]).to(device)


def unflatten(vec: torch.Tensor, layout: list[tuple[str, torch.Size]]) -> dict[str, torch.Tensor]:
    """Named views into a flat vector, in the layout's order."""
    out, offset = {}, 0
    for name, shape in layout:
        n = shape.numel()
        out[name] = vec[offset : offset + n].view(shape)
        offset += n
    return out


def chunked(fn, ctx: ClientContext, x: torch.Tensor) -> torch.Tensor:
    """fn(ctx, x) over x in chunks of CHUNK samples."""
    return torch.cat([fn(ctx, part) for part in x.split(CHUNK)])


class Taps(nn.Module):
    """Embedding and logits of a FedModel in one forward (``functional_call`` only calls ``forward``)."""

    def __init__(self, model: FedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.model.body(x)
        return features, self.model.head(features)


def mean_loss_terms(replies: dict[int, Reply]) -> dict[str, float]:
    """The sample-weighted mean over the replies of each loss term the posterior (or single) phase reports, named
    ``fedufo_<term>`` in metrics.jsonl: ``ce_loss`` and the weighted ``uad_loss``, ``cgr_loss``, ``cgl_loss`` of the
    terms that were active (per step, averaged; their sum is the engine's ``train_loss``), and ``disc_loss``, the
    discriminator's own loss. A term active for only some clients is averaged as 0 for the others."""
    n = sum(r.num_examples for r in replies.values())
    names = sorted({k for r in replies.values() for k in r.metrics if k.endswith("_loss") and k != "train_loss"})
    if not n:
        return {}
    return {f"fedufo_{k}": sum(r.metrics.get(k, 0.0) * r.num_examples for r in replies.values()) / n for k in names}


@ALGORITHMS.register(
    "fedufo",
    "FedUFO (Zhang et al. 2021): CE + UAD (client-ID discriminator) then + group and global consensus losses; "
    "disc_mode: federated (paper-literal: D averaged, carried across rounds) | fresh (new D per client per round, "
    "never reused) | frozen (D never trained)",
    FedUFOConfig,
)
class FedUFO(FedAvg):
    name = "fedufo"
    Config = FedUFOConfig
    unbatchable_reason = "its loss runs the other members' models and a discriminator held outside the flat vector"

    def __init__(self, config: FedUFOConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        super().__init__(config, setup, server_opt)
        # priors are needed by the discriminator's loss (UAD) and the group consensus (CGR); otherwise one exchange
        self.phases = ("prior", "posterior") if config.uad or config.cgr else ("train",)
        self._slices: dict[str, slice] | None = None
        self._taps: Taps | None = None
        self._layout: tuple[list, list] | None = None
        self._priors: dict[int, Reply] = {}  # phase A's replies, until phase B's messages are built
        self._losses: dict[str, float] = {}  # the last aggregated round's mean loss terms, for its metrics record

    @classmethod
    def prepare_federated_model(cls, config: FedUFOConfig, model: FedModel, num_clients: int) -> FedModel:
        if config.uad:
            disc = ClientDiscriminator(model.embedding_dim, num_clients, config.disc_hidden, config.disc_layers)
            setattr(model, DISC, disc)
        return model

    def disc_slice(self) -> slice | None:
        """Where D's parameters live in the flat vector (one module: contiguous), None without UAD."""
        if self._slices is None:
            with torch.random.fork_rng(devices=[]):  # building draws weights; the run's random stream must not move
                slices = FlatModel(self.setup.build_model()).slices()
            mine = [s for name, s in slices.items() if name.startswith(DISC + ".")]
            self._slices = {DISC: slice(mine[0].start, mine[-1].stop)} if mine else {}
        return self._slices.get(DISC)

    def in_stage_two(self, rnd: int) -> bool:
        return rnd > self.config.stage1_rounds

    # ----------------------------------------------------------------- server side
    def configure(self, rnd: int, cids: list[int], phase: str) -> dict[int, Message]:
        if phase != "posterior":
            return super().configure(rnd, cids, phase)
        group = [cid for cid in sorted(self._priors) if cid in cids]
        priors, self._priors = self._priors, {}
        if not group:
            return {}
        msg = self.global_message(rnd)
        msg.tensors["group"] = torch.tensor(group, dtype=torch.long)
        msg.tensors["prior_params"] = torch.stack([priors[c].tensors["params"] for c in group])
        if "buffers" in priors[group[0]].tensors:
            msg.tensors["prior_buffers"] = torch.stack([priors[c].tensors["buffers"] for c in group])
        counts = torch.stack([priors[c].tensors["counts"] for c in group])
        msg.tensors["counts"] = counts
        msg.tensors["proportions"] = class_proportions(counts)
        return {cid: msg for cid in group}  # one message, shared by every member

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        if phase == "prior":
            self._priors = dict(replies)  # relayed by configure("posterior"); the global model does not move
            return {}
        self._losses = mean_loss_terms(replies)
        c = self.config
        keep = self.disc_slice() if c.discriminator == "private" or c.disc_mode != "federated" else None
        if keep is None:
            return super().aggregate(rnd, replies, phase)
        # A private D never leaves its client, a fresh one is dropped and a frozen one never moves: the global D
        # slice (every client's initial D) stays as it is.
        weights = self.aggregation_weights(replies)
        target = weighted_sum([r.tensors["params"] for r in replies.values()], weights)
        target[keep] = self.global_params[keep]
        params = self.server_opt.step(self.global_params, target)
        params[keep] = self.global_params[keep]
        self.global_params = params
        self.average_buffers(replies, weights)
        return {}

    def round_metrics(self, rnd: int) -> dict[str, float]:
        return {"fedufo_stage": 2.0 if self.in_stage_two(rnd) else 1.0, **self._losses}

    # ----------------------------------------------------------------- client side
    def taps(self) -> Taps:
        """A model to run teachers through with functional_call (built once, in eval mode; its weights unused)."""
        if self._taps is None:
            with torch.random.fork_rng(devices=[]):  # building draws weights: keep the client's stream unchanged
                self._taps = Taps(self.setup.build_model()).eval()
        return self._taps

    def layout(self) -> tuple[list[tuple[str, torch.Size]], list[tuple[str, torch.Size]]]:
        """(name, shape) of the parameters and of the floating buffers, in the flat vectors' order."""
        if self._layout is None:
            model = self.taps().model
            params = [(f"model.{n}", p.shape) for n, p in model.named_parameters() if p.requires_grad]
            buffers = [(f"model.{n}", b.shape) for n, b in model.named_buffers() if b.is_floating_point()]
            self._layout = (params, buffers)
        return self._layout

    def teacher(self, params: torch.Tensor, buffers: torch.Tensor | None):
        """x -> (embedding, logits) of the model held in the flat vectors (views, no copy; no gradient)."""
        param_layout, buffer_layout = self.layout()
        tensors = unflatten(params, param_layout)
        if buffers is not None and buffers.numel():
            tensors.update(unflatten(buffers, buffer_layout))
        taps = self.taps()

        def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.no_grad():
                return functional_call(taps, tensors, (x,))

        return run

    def before_local(self, ctx: ClientContext) -> None:
        tensors = ctx.message.tensors
        disc = self.disc_slice()
        if ctx.phase == "prior" and self.config.prior_epochs is not None:
            ctx.train = ctx.train.model_copy(update={"local_epochs": self.config.prior_epochs})
        if ctx.phase != "prior":
            if self.config.posterior_init == "prior":
                row = self.own_row(ctx)
                ctx.flat.set_params(tensors["prior_params"][row])
                if "prior_buffers" in tensors:
                    ctx.flat.set_buffers(tensors["prior_buffers"][row])
            own = ctx.state.get(DISC)
            if disc is not None and self.config.discriminator == "private" and own is not None:
                ctx.flat.params[disc] = own
            if disc is not None and self.config.disc_mode == "fresh":
                ctx.flat.params[disc] = self.fresh_disc(ctx)
            ctx.scratch["ufo_losses"] = {}  # the loss terms of this phase's steps, summed (reply metrics)
            ctx.scratch["ufo_targets"] = self.cached_targets(ctx)
        if disc is not None:  # D is frozen while the model trains, in both phases
            ctx.scratch["ufo_disc"] = ctx.flat.params[disc].clone()
            if ctx.phase != "prior" and self.config.disc_schedule == "step" and self.trains_disc(ctx):
                ctx.scratch["ufo_disc_opt"] = self.disc_optimizer(ctx)
                ctx.scratch["ufo_disc_loss"] = 0.0
                if ctx.augment is None:  # the other members' features of every local sample, once per round
                    ctx.scratch["ufo_others"] = self.other_features(ctx, ctx.data.x)

    def fresh_disc(self, ctx: ClientContext) -> torch.Tensor:
        """disc_mode "fresh": this client's new D for this round, from its round seed."""
        c = self.config
        seed = fresh_disc_seed(ctx.generator.initial_seed())
        return fresh_discriminator(
            seed, ctx.model.embedding_dim, self.setup.num_clients, c.disc_hidden, c.disc_layers, ctx.flat.params.device
        )

    def cached_targets(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        """The consensus targets of every local sample, computed once per round (notes 8.14). With augmentation a
        batch's inputs are new each time, so its targets are computed per batch instead (empty dict)."""
        _, cgr, cgl = self.active(ctx)
        if ctx.augment is not None:
            return {}
        wanted = {"cgr": (cgr, self.group_target), "cgl": (cgl, self.global_target)}
        return {name: chunked(fn, ctx, ctx.data.x) for name, (on, fn) in wanted.items() if on}

    def target(self, ctx: ClientContext, name: str, x: torch.Tensor) -> torch.Tensor:
        cached = ctx.scratch["ufo_targets"].get(name)
        if cached is not None and ctx.batch is not None:
            return cached[ctx.batch]
        return (self.group_target if name == "cgr" else self.global_target)(ctx, x)

    def own_row(self, ctx: ClientContext) -> int:
        return int((ctx.message.tensors["group"] == ctx.cid).nonzero()[0, 0])

    def active(self, ctx: ClientContext) -> tuple[bool, bool, bool]:
        """(uad, cgr, cgl) for this client's phase and round."""
        if ctx.phase == "prior":
            return False, False, False
        c, two = self.config, self.in_stage_two(ctx.round)
        # without its own prior, a client alone in its group has no one to agree with: no CGR term
        cgr = c.cgr and two and (c.cgr_include_self or len(ctx.message.tensors["group"]) > 1)
        return c.uad, cgr, c.cgl and two

    def local_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        uad, cgr, cgl = self.active(ctx)
        if not (uad or cgr or cgl):
            loss = super().local_loss(ctx, x, y)  # the prior, and "cls": FedAvg's loss exactly
            if "ufo_losses" in ctx.scratch:  # not in the prior phase, whose reply reports no terms
                sums = ctx.scratch["ufo_losses"]
                sums["ce"] = sums.get("ce", 0.0) + float(loss.detach())
            return loss
        c = self.config
        if "ufo_disc_opt" in ctx.scratch:
            ctx.scratch["ufo_x"] = x  # the batch D trains on after this step (disc_schedule "step")
        features = ctx.model.body(x)
        logits = ctx.model.head(features)
        terms = {"ce": F.cross_entropy(logits, y)}
        if uad:
            terms["uad"] = c.uad_weight * uniform_loss(getattr(ctx.model, DISC)(features))
        if cgr:
            terms["cgr"] = c.cgr_weight * self.kl(logits, self.target(ctx, "cgr", x))
        if cgl:
            terms["cgl"] = c.cgl_weight * self.kl(logits, self.target(ctx, "cgl", x))
        sums = ctx.scratch["ufo_losses"]
        for name, term in terms.items():
            sums[name] = sums.get(name, 0.0) + float(term.detach())
        return sum(terms.values())

    def kl(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return kl_to_target(logits, target, self.config.kl_direction, self.config.kl_reduction)

    def group_target(self, ctx: ClientContext, x: torch.Tensor) -> torch.Tensor:
        """Eq. 6-7: the class-proportion-weighted fusion of every group member's prior prediction on x."""
        tensors = ctx.message.tensors
        buffers = tensors.get("prior_buffers")
        rows = list(range(len(tensors["group"])))
        proportions = tensors["proportions"]
        if not self.config.cgr_include_self:
            rows.remove(self.own_row(ctx))
            proportions = class_proportions(tensors["counts"][rows])
        probs = []
        for row in rows:
            params = tensors["prior_params"][row]
            _, logits = self.teacher(params, None if buffers is None else buffers[row])(x)
            probs.append(F.softmax(logits, dim=1))
        return fuse_group(torch.stack(probs), proportions, self.config.cgr_fusion)

    def global_target(self, ctx: ClientContext, x: torch.Tensor) -> torch.Tensor:
        """Eq. 9: the received global model's prediction on x."""
        tensors = ctx.message.tensors
        _, logits = self.teacher(tensors["params"], tensors.get("buffers"))(x)
        return F.softmax(logits, dim=1)

    def after_backward(self, ctx: ClientContext) -> None:
        disc = self.disc_slice()
        if disc is not None:
            ctx.flat.grad[disc] = 0.0  # D frozen: no part in the step, nor in the clipped norm

    def after_step(self, ctx: ClientContext) -> None:
        disc = self.disc_slice()
        if disc is None:
            return
        ctx.flat.params[disc] = ctx.scratch["ufo_disc"]  # undo weight decay and momentum on the frozen D
        opt = ctx.scratch.get("ufo_disc_opt")
        if opt is not None:  # disc_schedule "step": now D's turn, on this batch's features, the model frozen
            x = ctx.scratch.pop("ufo_x")
            others = self.batch_others(ctx, x)
            ctx.scratch["ufo_disc_loss"] += self.disc_step(ctx, opt, self.own_features(ctx, x), others)
            ctx.scratch["ufo_disc"] = ctx.flat.params[disc].clone()

    def after_local(self, ctx: ClientContext) -> Reply:
        if ctx.phase == "prior":
            reply = super().after_local(ctx)
            reply.tensors["counts"] = ctx.data.label_counts()
            return reply
        disc = self.disc_slice()
        if "ufo_disc_opt" in ctx.scratch:  # trained step by step already
            disc_loss = ctx.scratch["ufo_disc_loss"] / max(ctx.steps, 1)
        else:
            disc_loss = self.train_discriminator(ctx) if self.trains_disc(ctx) else 0.0
        if disc is not None and self.config.discriminator == "private":
            ctx.state[DISC] = ctx.flat.params[disc].clone()
            ctx.flat.params[disc] = ctx.global_params[disc]  # a private D never leaves the client
        if disc is not None and self.config.disc_mode == "fresh":
            ctx.flat.params[disc] = ctx.global_params[disc]  # a fresh D is dropped after its round
        reply = super().after_local(ctx)
        steps = max(ctx.steps, 1)
        reply.metrics.update({f"{k}_loss": v / steps for k, v in ctx.scratch["ufo_losses"].items()})
        if disc is not None:
            reply.metrics["disc_loss"] = disc_loss
        return reply

    def trains_disc(self, ctx: ClientContext) -> bool:
        """Whether D trains in this round: it exists, disc_mode is not "frozen", and stage two lets it unless
        disc_in_stage_two is false."""
        c = self.config
        if self.disc_slice() is None or c.disc_mode == "frozen":
            return False
        return c.disc_in_stage_two or not self.in_stage_two(ctx.round)

    def own_features(self, ctx: ClientContext, x: torch.Tensor) -> torch.Tensor:
        """The posterior's features of x as constants: eval mode (no dropout, running statistics as they are)."""
        ctx.model.eval()
        with torch.no_grad():
            own = torch.cat([ctx.model.body(part) for part in x.split(CHUNK)])
        ctx.model.train()
        return own

    def other_features(self, ctx: ClientContext, x: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """(features of x under member j's prior, j) for every other group member (Eq. 1)."""
        tensors = ctx.message.tensors
        buffers = tensors.get("prior_buffers")
        others = []
        for row, cid in enumerate(tensors["group"].tolist()):
            if cid != ctx.cid:
                run = self.teacher(tensors["prior_params"][row], None if buffers is None else buffers[row])
                others.append((torch.cat([run(part)[0] for part in x.split(CHUNK)]), cid))
        return others

    def batch_others(self, ctx: ClientContext, x: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """other_features of the current batch: looked up in the round's cache, or computed (augmented inputs)."""
        cached = ctx.scratch.get("ufo_others")
        if cached is None:
            return self.other_features(ctx, x)
        return [(f[ctx.batch], cid) for f, cid in cached]

    def disc_optimizer(self, ctx: ClientContext) -> FlatOptimizer:
        """The loop's optimiser and settings on D's slice only (no gradient clipping), fresh every round."""
        disc = self.disc_slice()
        view = SimpleNamespace(params=ctx.flat.params[disc], grad=ctx.flat.grad[disc])
        return local_optimizer(view, ctx.lr, ctx.train)

    def disc_step(
        self, ctx: ClientContext, opt: FlatOptimizer, own: torch.Tensor, others: list[tuple[torch.Tensor, int]]
    ) -> float:
        """One optimiser step of D on Eq. 5 for one batch of features; returns the loss."""
        ctx.flat.zero_grad()
        loss = discriminator_loss(getattr(ctx.model, DISC), own, ctx.cid, others)
        loss.backward()
        opt.step()
        ctx.flat.zero_grad()
        return float(loss.detach())

    def train_discriminator(self, ctx: ClientContext) -> float:
        """Eq. 5 for ``disc_epochs`` epochs with the model frozen: steps on D's slice only. Returns the mean loss."""
        n = len(ctx.data)
        if self.config.disc_epochs == 0 or ctx.message.tensors.get("group") is None or n == 0:
            return 0.0
        own = self.own_features(ctx, ctx.data.x)
        others = self.other_features(ctx, ctx.data.x)
        opt = self.disc_optimizer(ctx)
        t = ctx.train
        total = num_local_steps(n, t.batch_size, self.config.disc_epochs, None)
        loss_sum = 0.0
        for idx in batch_indices(n, t.batch_size, total, ctx.generator, own.device):
            loss_sum += self.disc_step(ctx, opt, own[idx], [(f[idx], cid) for f, cid in others])
        return loss_sum / total


# ------------------------------------------------------------------------ presets (Tables 1 and 3-5)
class FedUADConfig(FedUFOConfig):
    cgr: bool = False  # FedUAD = stage one only: CE + UAD in every round (Table 1; "+uad" of Table 3)
    cgl: bool = False
    tunable: ClassVar[dict[str, str]] = {}  # without CGL, lambda weighs nothing


class FedUFOClsConfig(FedUFOConfig):
    uad: bool = False  # "cls" of Table 3: CE only, "equals to FedAVG method actually"
    cgr: bool = False
    cgl: bool = False
    tunable: ClassVar[dict[str, str]] = {}


class FedUFOCgrConfig(FedUFOConfig):
    uad: bool = False  # "+cgr": CE + CGR, single stage (notes 2.5.6)
    cgl: bool = False
    tunable: ClassVar[dict[str, str]] = {}
    stage1_rounds: int = Field(0, ge=0)


class FedUFOCglConfig(FedUFOConfig):
    uad: bool = False  # "+cgl": CE + lambda CGL, single stage (notes 2.5.6)
    cgr: bool = False
    stage1_rounds: int = Field(0, ge=0)


class FedUFOUadCgrConfig(FedUFOConfig):
    cgl: bool = False  # "+uad+cgr": stage one CE + UAD, stage two adds CGR
    tunable: ClassVar[dict[str, str]] = {}


class FedUFOUadCglConfig(FedUFOConfig):
    cgr: bool = False  # "+uad+cgl": stage one CE + UAD, stage two adds lambda CGL


PRESETS = {
    "feduad": (FedUADConfig, "FedUAD (Zhang et al. 2021): FedUFO's stage one, CE + UAD in every round"),
    "fedufo_cls": (FedUFOClsConfig, "FedUFO ablation 'cls' (Table 3): CE only, i.e. FedAvg"),
    "fedufo_cgr": (FedUFOCgrConfig, "FedUFO ablation '+cgr' (Table 3): CE + group consensus, one stage"),
    "fedufo_cgl": (FedUFOCglConfig, "FedUFO ablation '+cgl' (Table 3): CE + 3 x global consensus, one stage"),
    "fedufo_uad_cgr": (FedUFOUadCgrConfig, "FedUFO ablation '+uad+cgr' (Table 3): CE + UAD, then + CGR"),
    "fedufo_uad_cgl": (FedUFOUadCglConfig, "FedUFO ablation '+uad+cgl' (Table 3): CE + UAD, then + 3 x CGL"),
}


def register_preset(name: str, config: type[FedUFOConfig], summary: str) -> type[FedUFO]:
    preset = type(f"FedUFO_{name}", (FedUFO,), {"name": name, "Config": config, "__module__": __name__})
    return ALGORITHMS.register(name, summary, config)(preset)


for _name, (_config, _summary) in PRESETS.items():
    register_preset(_name, _config, _summary)
