"""The algorithm contract.

An algorithm is one file holding one ``Algorithm`` subclass:

* ``Config``: a pydantic model of its hyper-parameters, each default commented with its source.
* Messages: the server sends each client a ``Message`` (named tensors + named scalars) and gets back a ``Reply``
  (named tensors + named scalars + number of examples + metrics). Nothing else crosses the wire, so the same code runs
  in the in-process simulation and over Flower.
* Client side: ``client_update(phase, ctx)`` runs the one shared local-training loop
  (``fedhet.algorithms.loop.train_locally``), which calls the hooks ``before_local``, ``local_loss``,
  ``after_backward``, ``after_step`` and ``after_local``. Algorithms override hooks, never the loop. Client-side code
  may only use what ``ctx`` holds (the message, the client's data and its persistent state), never server attributes.
* Server side: ``configure(round, clients, phase)`` builds the messages and ``aggregate(round, replies, phase)``
  folds the replies into the global model. The final model step goes through a composable server optimiser
  (``fedhet.algorithms.server_opt``), so FedAvgM/FedAdam work with any client method.
* Normalisation buffers (BatchNorm's running mean and variance, the model's floating buffers) follow one rule: the
  server averages them with the algorithm's aggregation weights and sends the average with the model, except the
  entries of ``kept_buffers``, which stay on each client (in its state) and which the server never moves (FedBN:
  every BatchNorm layer's; FedPer: those of its personalisation layers). A personalised model is scored with the
  buffers ``personal_buffers`` gives (by default the global ones).
* State: ``client_state`` is client-held persistent state (control variates, previous models), stored by the engine's
  state store between rounds; server-held state (global model, per-client duals) is returned by ``state_dict``.
* Rounds with several exchanges list their ``phases``; each phase is a configure / train / aggregate triple.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from pydantic import ConfigDict

from fedhet.algorithms.contract import ClientContext, Message, Reply, Scalar, Setup  # noqa: F401  (the types)
from fedhet.algorithms.functional import record_aux, split_loss
from fedhet.algorithms.loop import train_locally
from fedhet.algorithms.privacy import CentralDP, LocalDP
from fedhet.algorithms.server_opt import ServerOptimizer
from fedhet.data.types import ClientData  # noqa: F401  (re-exported: plug-ins import it from here)
from fedhet.params import Params
from fedhet.registry import Registry
from fedhet.toolkit.flat import weighted_sum  # noqa: F401  (algorithms import it from here)

if TYPE_CHECKING:
    from torch import nn

    from fedhet.algorithms.gne import GNE
    from fedhet.algorithms.robust import RobustAggregator
    from fedhet.config import TrainSection
    from fedhet.models.base import FedModel
    from fedhet.toolkit.lora import LoraAggregator

ALGORITHMS = Registry("algorithm", section="algorithm")


class AlgoConfig(Params):
    model_config = ConfigDict(frozen=True)


class Algorithm:
    name: ClassVar[str] = "base"
    Config: ClassVar[type[AlgoConfig]] = AlgoConfig
    phases: ClassVar[tuple[str, ...]] = ("train",)
    sends_buffers: ClassVar[bool] = True
    # True: this class's ``aggregate`` forms its target with ``aggregate_target`` (a weighted average of the client
    # models), so ``server.aggregation = "gne"`` can replace the weights. Read from the class that defines the
    # ``aggregate`` in use (``accepts_gne``): a subclass that overrides ``aggregate`` must declare it again.
    weighted_aggregate: ClassVar[bool] = True
    # what else a weighted-average server reads from the replies where ``central_dp = False`` refuses central DP,
    # for its one-line refusal
    central_dp_unprivatised: ClassVar[str] = "other tensors in the replies, computed from the clients' data"

    @property
    def local_model_phase(self) -> str:
        """The phase whose replies hold the locally trained models, which ``run.eval_local_models`` scores (FedACD's
        Tables 3 and 9): the round's last phase, unless a later one only measures the new global model."""
        return self.phases[-1]

    def __init__(self, config: AlgoConfig, setup: Setup, server_opt: ServerOptimizer | None = None) -> None:
        self.config = config
        self.setup = setup
        self.server_opt = server_opt or ServerOptimizer()
        self.global_params: torch.Tensor | None = None
        self.global_buffers: torch.Tensor | None = None
        self.gne: GNE | None = None  # server.aggregation = "gne": Nash-bargaining weights (algorithms/gne.py)
        # a robust server.aggregation rule and/or server.norm_bound (algorithms/robust.py)
        self.robust: RobustAggregator | None = None
        self.privacy: CentralDP | LocalDP | None = None  # [privacy]'s server half (algorithms/privacy.py)
        # indices into the flat buffer vector of the buffers that stay on each client and that the server never
        # moves (FedBN: every BatchNorm layer's statistics); None: every buffer is averaged (the default rule)
        self.kept_buffers: torch.Tensor | None = None
        # server.lora_aggregation = "flexlora" or heterogeneous LoRA ranks: the adapters' rule (toolkit/lora.py)
        self.lora: LoraAggregator | None = None

    # Why this method's math holds for SGD local steps only (its server reads a client's update as gradient steps of
    # size lr), completing "<name> ...": ``train.optimizer = adam | adamw`` is refused with it. Inherited.
    sgd_only: ClassVar[str | None] = None
    # Why this method needs the model's own head to train as it is, completing "<name> ...": a run whose
    # ``model.freeze`` or ``model.lora_targets`` names the head is refused with it. Inherited.
    head_refusal: ClassVar[str | None] = None

    @classmethod
    def optimizer_refusal(cls, config: AlgoConfig, train: TrainSection) -> str | None:
        """Why this method cannot train with ``train``'s local optimiser, in one line, or None (it can)."""
        if train.optimizer != "sgd" and cls.sgd_only:
            return f"{cls.name} {cls.sgd_only}; use train.optimizer='sgd'"
        return None

    @classmethod
    def accepts_gne(cls) -> bool:
        """Whether the ``aggregate`` this class uses is a weighted average that GNE's weights can replace."""
        owner = next(c for c in cls.__mro__ if "aggregate" in c.__dict__)
        return bool(owner.__dict__.get("weighted_aggregate", False))

    @classmethod
    def accepts_central_dp(cls) -> bool:
        """Whether central DP can privatise this class's aggregation: a weighted average (``aggregate_target``
        adds the clipped, noised mean), or an ``aggregate`` that privatises its own vectors (``central_dp = True``,
        SCAFFOLD's joint (delta_y, delta_c)); ``central_dp = False`` refuses a weighted average whose replies carry
        other data-derived tensors the server uses (FedNH's prototype sums)."""
        owner = next(c for c in cls.__mro__ if "aggregate" in c.__dict__)
        return bool(owner.__dict__.get("central_dp", owner.__dict__.get("weighted_aggregate", False)))

    def use_gne(self, gne: GNE) -> None:
        """Aggregate with GNE's Nash-bargaining weights instead of ``aggregation_weights`` (server side only)."""
        if not self.accepts_gne():
            raise ValueError(f"{self.name}'s aggregation is not a weighted average of client models: no GNE")
        self.gne = gne

    @classmethod
    def prepare_model(cls, config: AlgoConfig, model: FedModel) -> FedModel:
        """Add algorithm-owned modules to a freshly built model (MOON's projection head, personal heads, ...).

        Runs on the server and on every client before parameters are flattened, so whatever is added here is part
        of the exchanged and aggregated parameter vector."""
        return model

    @classmethod
    def prepare_federated_model(cls, config: AlgoConfig, model: FedModel, num_clients: int) -> FedModel:
        """Like ``prepare_model``, for modules whose shape depends on the federation: ``num_clients`` is the number
        of clients (FedUFO's client-ID discriminator has one output per client). Runs right after it."""
        return model

    # ----------------------------------------------------------------- server side
    def init_server(self, params: torch.Tensor, buffers: torch.Tensor) -> None:
        self.global_params = params.clone()
        self.global_buffers = buffers.clone()
        self.server_opt.init(self.global_params)

    def configure(self, rnd: int, cids: list[int], phase: str) -> dict[int, Message]:
        msg = self.global_message(rnd)
        return {cid: msg for cid in cids}

    def global_message(self, rnd: int) -> Message:
        """The global model plus the round's client learning rate (decayed per round for every algorithm)."""
        tensors = {"params": self.global_params}
        if self.sends_buffers and self.global_buffers.numel():
            tensors["buffers"] = self.global_buffers
        return Message(tensors=tensors, scalars={"round": rnd, "lr": self.round_lr(rnd)})

    def round_lr(self, rnd: int) -> float:
        train = self.setup.train
        return train.lr * train.lr_decay ** (rnd - 1)

    def aggregate(self, rnd: int, replies: dict[int, Reply], phase: str) -> dict[str, float]:
        """Weighted average of the replied models, applied through the server optimiser."""
        weights = self.aggregation_weights(replies)
        target = self.aggregate_target(replies, weights)
        self.global_params = self.server_opt.step(self.global_params, target)
        self.average_buffers(replies, weights)
        return {}

    def aggregate_empty(self, rnd: int, phase: str) -> None:
        """``phase`` of round ``rnd`` ended with no reply: nothing to aggregate, and the model stays. Except under
        central DP, whose guarantee covers every round only if every round releases a noised mean (an unchanged
        model would tell that every sampled client failed, which depends on their data): the mean of m zero updates
        plus the round's noise is applied, and the round is accounted. Algorithms that privatise their own vectors
        (``central_dp = True``) override this with their own noise-only release."""
        if isinstance(self.privacy, CentralDP):
            target = self.global_params + self.privacy.mean([], like=self.global_params)
            self.global_params = self.server_opt.step(self.global_params, target)

    def aggregate_target(self, replies: dict[int, Reply], weights: list[float]) -> torch.Tensor:
        """The weighted average of the replied models; with GNE, x + G p (``weights`` are then its fallback)."""
        params = [r.tensors["params"] for r in replies.values()]
        if isinstance(self.privacy, CentralDP):
            # central DP replaces the weights by DP-FedAvg's fixed ones (algorithms/privacy.py)
            return self.global_params + self.privacy.mean([p - self.global_params for p in params])
        if self.robust is not None:
            return self.robust.target(self.global_params, params, weights, self.average)
        if self.lora is not None:
            return self.lora.target(self.average(params, weights), params, weights, list(replies), self.global_params)
        return self.average(params, weights)

    def average(self, params: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        """The algorithm's weighted average of ``params``; with GNE, x + G p (``weights`` are then its fallback)."""
        if self.gne is None:
            return weighted_sum(params, weights)
        return self.gne.target(self.global_params, params, weights)

    def aggregation_weights(self, replies: dict[int, Reply]) -> list[float]:
        sizes = [float(r.num_examples) for r in replies.values()]
        total = sum(sizes)
        return [s / total for s in sizes]

    def average_buffers(self, replies: dict[int, Reply], weights: list[float]) -> None:
        """The buffer rule's server half: the weighted average of the replied buffers, except ``kept_buffers``,
        which keep their global values bit for bit (the clients keep their own)."""
        if self.global_buffers is None or not self.global_buffers.numel():
            return
        averaged = weighted_sum([r.tensors["buffers"] for r in replies.values()], weights)
        if self.kept_buffers is not None:
            averaged[self.kept_buffers] = self.global_buffers[self.kept_buffers]
        self.global_buffers = averaged

    def round_metrics(self, rnd: int) -> dict[str, float]:
        """Extra server-side values to log at an evaluation round (aggregation weights, duals, ...)."""
        return {}

    def extra_eval_params(self) -> dict[str, torch.Tensor]:
        """Other parameter vectors to score on the global test set at evaluation rounds, by name; each is logged as
        ``{name}_acc`` and ``{name}_loss`` (FedDyn's server model and client average). They use the global buffers."""
        return {}

    def aggregation_metrics(self) -> dict[str, float]:
        """The diagnostics of GNE, of a robust rule or norm bound, and of [privacy], for the last aggregation
        (logged beside ``round_metrics``); none with the plain weighted average."""
        out = {} if self.gne is None else self.gne.metrics()
        out = out if self.robust is None else {**out, **self.robust.metrics()}
        return out if self.privacy is None else {**out, **self.privacy.metrics()}

    def account(self, replies: dict[int, Reply]) -> None:
        """Tell the privacy ledger which clients trained how many steps (local DP-SGD's per-client epsilon)."""
        if isinstance(self.privacy, LocalDP):
            self.privacy.observe(replies)

    def state_dict(self) -> dict[str, Any]:
        state = {
            "global_params": self.global_params,
            "global_buffers": self.global_buffers,
            "server_opt": self.server_opt.state_dict(),
        }
        if self.gne is not None:
            state["gne"] = self.gne.state_dict()
        if self.privacy is not None:
            state["privacy"] = self.privacy.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_params = state["global_params"]
        self.global_buffers = state["global_buffers"]
        self.server_opt.load_state_dict(state["server_opt"])
        if self.gne is not None:
            self.gne.load_state_dict(state["gne"])
        if self.privacy is not None:
            self.privacy.load_state_dict(state["privacy"])

    # ----------------------------------------------------------------- client side
    # True: several clients of a phase may be trained as one batched computation (engine/batched.py). A class
    # declares it only if it keeps the default ``local_loss`` (its own loss goes in ``loss`` / ``loss_inputs``, which
    # the batched executor runs under vmap) and ``client_update`` and its hooks use nothing but
    # the flat vectors (``ctx.flat.params`` / ``grad`` / ``get_params`` / ``set_params``), ``ctx.message``,
    # ``ctx.state``, ``ctx.scratch``, ``ctx.data``, ``ctx.lr``, ``ctx.steps`` and ``ctx.generator``: never
    # ``ctx.model``, the global RNG or ``ctx.scratch["optimizer"]``; ``ctx.loss_sum`` is filled in only before
    # ``after_local``. Exception: ``before_local``, ``loss_inputs`` and ``after_local`` may evaluate ``ctx.model``
    # (the executor loads the client's row into it first). Each hook then runs on its client's row of the stacked
    # parameters. Not inherited: a subclass that changes the loss is sequential unless it declares it too. A class
    # that cannot be batched says why in one line, ``unbatchable_reason`` (inherited by its variants;
    # tests/test_batched.py checks every algorithm).
    batchable: ClassVar[bool] = False
    unbatchable_reason: ClassVar[str | None] = None
    # The phases in which a batchable class's own ``client_update`` is the shared loop (``super().client_update``):
    # those are batched, the others run sequentially (SphereFed's calibration). Not inherited.
    loop_phases: ClassVar[tuple[str, ...]] = ()
    # True: ``loss_inputs`` changes during local training (FedACD's per-batch mixup draw and per-epoch P), so both
    # executors read it at every step, after the batch is drawn and augmented (``ctx.batch`` set). Inherited.
    step_inputs: ClassVar[bool] = False
    # True: local DP-SGD (``privacy.mode = "local"``) covers everything this client sends. A class declares it (not
    # inherited) when its ``local_loss`` is a sum of per-sample terms that vmap can take one sample at a time and no
    # other hook reads the client's data, so the reply is computed from privatised gradients only.
    dp_sgd: ClassVar[bool] = False
    # True: the simulation trains one client holding every client's training data and evaluates on the partition's
    # clients (the centralized upper bound); not possible over Flower, where the data stay on the nodes
    pools_clients: ClassVar[bool] = False
    # True: a data-sharing method; the engine hands the server the clients' shared copies through
    # ``receive_shared_data(fed, seed)`` before round 1 (FedMeta)
    shares_data: ClassVar[bool] = False
    personalized: ClassVar[bool] = False  # True: the engine reports personalised accuracy via ``personalize``
    # Key prefix of the personalised metrics ({prefix}_acc_micro, ...). An algorithm whose personalisation breaks
    # the protocol (FedBC-FineTune fine-tuned on test data) returns a different one, so its numbers stay marked.
    personal_metric_prefix: str = "personal"

    def personalize(self, ctx: ClientContext) -> torch.Tensor | None:
        """The client's personalised model as a flat parameter vector, for personalised evaluation.

        Runs on the client with ``ctx.message`` holding the current global model and ``ctx.state`` the client's
        state; it may train (a fine-tuning step) but only on ``ctx.data.x`` / ``ctx.data.y``, never on the test
        split. Return None when this client has no personalised model."""
        return None

    def personal_buffers(self, ctx: ClientContext) -> torch.Tensor | None:
        """The buffers (normalisation statistics) to score the client's personalised model with: the received
        global ones, unless the algorithm keeps some on the client (``kept_buffers``). None: the model has none."""
        return ctx.message.tensors.get("buffers")

    def client_update(self, ctx: ClientContext) -> Reply:
        return train_locally(self, ctx)

    def before_local(self, ctx: ClientContext) -> None:
        """Called after the received model is loaded, before the first step."""

    def local_loss(self, ctx: ClientContext, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss the loop differentiates: ``loss`` on the client's model. Override ``loss`` and ``loss_inputs``
        rather than this, so the batched executor can run the same loss (algorithms/functional.py)."""
        loss, aux = split_loss(self.loss(ctx.model, x, y, self.loss_inputs(ctx)))
        if aux:
            record_aux(ctx.scratch, aux)
        return loss

    def loss_inputs(self, ctx: ClientContext) -> dict[str, torch.Tensor]:
        """The tensors ``loss`` reads besides the model and the batch, fixed during the client's local training
        (computed in ``before_local``, kept in ``ctx.scratch``): the batched executor reads them once per client,
        or at every step where the class declares ``step_inputs``."""
        return {}

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The client loss of a batch, a function of the model (at the client's current parameters) and
        ``inputs`` only: no ``ctx``, no in-place state, no data-dependent shapes, so it also runs under ``vmap``.
        It may return (loss, {name: 0-d tensor}) for values a later hook reads (``functional.aux_sums``)."""
        return F.cross_entropy(model(x), y)

    def after_backward(self, ctx: ClientContext) -> None:
        """Called with ``ctx.flat.grad`` holding the loss gradient; add gradient terms here."""

    def after_step(self, ctx: ClientContext) -> None:
        """Called after each optimiser step."""

    def after_local(self, ctx: ClientContext) -> Reply:
        tensors = {"params": ctx.flat.get_params()}
        if self.sends_buffers and ctx.flat.buffers.numel():
            tensors["buffers"] = ctx.flat.get_buffers()
        return Reply(
            tensors=tensors,
            num_examples=len(ctx.data),
            metrics={"train_loss": ctx.loss_sum / max(ctx.steps, 1), "steps": float(ctx.steps)},
        )
