"""Run configuration: TOML file + dotted overrides -> one validated, fully resolved config.

Sections: ``run``, ``dataset``, ``partition``, ``model``, ``train``, ``algorithm``, ``server``, ``tracking``,
``privacy``, ``attack``, ``system``. The component sections (``dataset``, ``partition``, ``model``, ``algorithm``,
``server``) hold a ``name`` plus that component's own parameters, which the component's registry entry validates;
resolution fills every default in, so a run folder's ``config.json`` shows exactly what ran.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from fedhet.errors import ConfigError, suggestion
from fedhet.params import Params, Seed, problem, shown
from fedhet.registry import section_keys

if TYPE_CHECKING:
    from fedhet.models.adapt import LoraSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class _Strict(Params):
    model_config = ConfigDict(validate_assignment=True)


class RunSection(_Strict):
    name: str | None = None  # default: derived from algorithm, dataset, partition and seed
    seed: Seed = 0  # seeds every random stream: partition (unless partition.seed), initial model, sampling
    rounds: int = Field(20, ge=1)  # communication rounds to train (a finished run can be extended)
    out_dir: str = "runs"  # parent folder of run folders (relative: to the working directory)
    eval_every: int = Field(1, ge=1)  # evaluate every N rounds (and always the last)
    checkpoint_every: int = Field(1, ge=1)  # write a checkpoint every N rounds (and always the last)
    ema: float = Field(0.9, ge=0.0, lt=1.0)  # FedRCL reports accuracy EMA with 0.9 (notes/fedrcl.md section 4)
    device: str = "cpu"  # cpu, cuda, cuda:N or mps
    eval_batch_size: int = Field(1024, ge=1)  # batch size of evaluation passes (no effect on the numbers)
    progress: bool = True  # the progress bar (a terminal) or one line per evaluation (redirected output)
    # where client-held state lives: "auto" keeps it in memory until it passes the budget, then moves it to disk
    client_state: Literal["auto", "memory", "disk"] = "auto"
    client_state_budget_mb: float = Field(2048.0, gt=0.0)  # with client_state = "auto": memory before disk
    # stop (with an error) after this many rounds in a row in which every client failed
    max_empty_rounds: int = Field(3, ge=1)
    # processes that train a round's clients (one thread each); 0 = auto: one per core on a CPU with >= 4 cores and
    # >= 2 clients per round, else 1 (in-process). Any count >= 2 gives the same bits as 1 worker with 1 thread.
    workers: int = Field(0, ge=0)
    # personalised accuracy is measured on at most this many clients (a seeded sample, logged); None = all
    personal_eval_clients: int | None = Field(1000, ge=1)
    # how a phase's clients train: one after another, or several as one batched computation (engine/batched.py;
    # same results to float rounding); "auto" batches only where docs/performance.md measured it to pay off
    executor: Literal["auto", "sequential", "batched"] = "auto"
    # clients trained together by the batched executor; 0 = auto: on a GPU as many as the free device memory holds
    # (engine/batched.py, group_size), elsewhere 32. Changes only float rounding, like run.executor
    max_group: int = Field(0, ge=0)
    # torch.compile of the local step in this mode: the batched executor's (the group's vmapped forward, loss and
    # backward) and the sequential loop's (forward and backward of the algorithm's loss; not where the algorithm has
    # its own local_loss hook, nor under local DP-SGD, which the run then says). "reduce-overhead" replays it as
    # CUDA graphs on a GPU, where small steps are bound by kernel launches. The first steps pay the compile time
    # (twice or three times: a fixed and then a dynamic batch or client count, a batch of one sample); changes only
    # float rounding (the compiler fuses kernels), like run.executor
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = "off"
    # FedACD's Tables 3 and 9 for any algorithm: each participant's local model (as local training left it) is
    # evaluated on the test set (local_risk: its error averaged over every client's label distribution, Eq. 3) and
    # on its own training data (local_kl: KL(P^m || Q), App. A.2); one extra pass of each per participant per round
    eval_local_models: bool = False
    # FedACD's Table 2 read as physical test sets (notes/fedacd.md 4.5): each client's test sample is drawn once,
    # with its training label proportions, from the global test set (client_dist_acc_sampled); the exact
    # expectation, client_dist_acc, is always logged
    client_dist_sampled: bool = False
    client_dist_sample_size: int | None = Field(None, ge=1)  # None: as many as the client's training samples
    # each client's Reply.metrics per evaluated round in client_metrics.jsonl (their mean/min/max/weighted mean
    # always go to metrics.jsonl); changes no number
    client_metrics: bool = False
    # plug-ins that register components from outside fedhet (fedhet/plugins.py): .py files (absolute once built;
    # in a TOML file relative to its folder) or module names; installed entry points need no mention
    plugins: list[str] = []

    @field_validator("plugins")
    @classmethod
    def _plugins(cls, value: list[str]) -> list[str]:
        from fedhet.plugins import normalise

        return list(dict.fromkeys(normalise(no_nul(spec)) for spec in value))

    @field_validator("name")
    @classmethod
    def _folder_name(cls, value: str | None) -> str | None:
        # the run's folder under out_dir, which --overwrite deletes: "", "." or ".." would take out_dir or more with
        # it, a path would reach outside it; brackets would be read as markup where the name is printed
        bad = value in ("", ".", "..") or any(c in "/\\[]" or ord(c) < 32 for c in value or "")
        if value is not None and (bad or value != value.strip()):
            raise ValueError(
                "must be a plain folder name: not '', '.' or '..'; no '/', '\\', '[', ']', control characters or "
                "surrounding spaces"
            )
        return value

    @field_validator("out_dir")
    @classmethod
    def _path(cls, value: str) -> str:
        return no_nul(value)

    @field_validator("device")
    @classmethod
    def _device(cls, value: str, info: ValidationInfo) -> str:
        check_device(value, available=(info.context or {}).get("runs_here", True))
        return value


def no_nul(path: str | None) -> str | None:
    if path is not None and "\x00" in path:
        raise ValueError("must not contain a NUL character")
    return path


def available_devices() -> list[str]:
    """The devices this machine's torch can compute on: cpu, then cuda, cuda:0, ... and mps where present."""
    import torch

    out = ["cpu"]
    if torch.cuda.is_available():
        out += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    if torch.backends.mps.is_available():
        out.append("mps")
    return out


def check_device(text: str, available: bool = True) -> None:
    """Refuse a device torch cannot parse or fedhet does not run on; with ``available``, also one this machine lacks.

    ``available=False`` is for a config written here to run elsewhere (a Flower app), checked again where it runs."""
    import torch

    choices = f"available here: {', '.join(available_devices())}"
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"not a device torch knows; {choices}") from None
    single = device.type in ("cpu", "mps") and device.index in (None, 0)
    if not (single or device.type == "cuda"):
        raise ValueError(f"not a device fedhet runs on (cpu, cuda, cuda:N, mps); {choices}")
    if not available or device.type == "cpu":
        return
    if device.type == "cuda":
        present = torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    else:
        present = torch.backends.mps.is_available()
    if not present:
        raise ValueError(f"not available on this machine; {choices}")


class TrainSection(_Strict):
    participation: float = Field(1.0, gt=0.0, le=1.0)  # fraction of clients per round
    clients_per_round: int | None = Field(None, ge=1)  # overrides participation when set
    local_epochs: float = Field(1.0, gt=0.0)  # passes over its data a client makes per round
    local_steps: int | None = Field(None, ge=1)  # a fixed number of local steps, overrides local_epochs
    batch_size: int = Field(64, ge=1)  # local mini-batch size
    # the clients' local optimiser (torch.optim's SGD, Adam, AdamW on the flat parameter vector); scaffold, fednova
    # and qfedavg read the local steps as SGD steps and refuse adam and adamw
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(0.01, gt=0.0)  # client learning rate
    lr_decay: float = Field(1.0, gt=0.0, le=1.0)  # per-round multiplicative client lr decay (FedRCL: 0.998)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)  # client SGD momentum (sgd only)
    nesterov: bool = False  # Nesterov momentum (sgd only; needs momentum > 0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)  # adam/adamw: decay of the gradient's running mean (torch's default)
    beta2: float = Field(0.999, ge=0.0, lt=1.0)  # adam/adamw: decay of the squared gradient's mean (torch's default)
    eps: float = Field(1e-8, gt=0.0)  # adam/adamw: added to the denominator (torch's default)
    # sgd and adam: L2 weight decay added to the gradient; adamw: decoupled decay w <- w (1 - lr wd) (torch's AdamW
    # default is 0.01; here 0 for every optimiser, so switching optimiser adds no decay)
    weight_decay: float = Field(0.0, ge=0.0)
    # "reset": the optimiser's state (momentum buffer, Adam's moments and step count) starts anew every round, the
    # common practice; "client": each client keeps its own in the client-state store (run.client_state) from one
    # round it trains in to the next, one per phase, checkpointed with the run
    optimizer_state: Literal["reset", "client"] = "reset"
    grad_clip: float | None = Field(None, gt=0.0)  # max global gradient norm
    augment: Literal["none", "crop_flip", "crop_flip_rotate", "crop"] = "none"  # client-side image augmentation
    # the local forward pass and loss in float32, or under bfloat16 autocast (weights, gradients and the update stay
    # float32); both executors. Changes the numbers, so a resume cannot change it
    precision: Literal["fp32", "bf16"] = "fp32"
    # how a round's clients are chosen: "uniform" at random; "dynamic" is FedUFO's dynamic sampling (Sec. 3.3.2):
    # a sampling_worst share of them are the clients the current global model serves worst, the rest at random
    sampling: Literal["uniform", "dynamic"] = "uniform"
    sampling_worst: float = Field(0.5, ge=0.0, le=1.0)  # FedUFO: K_c / 2 lowest-performing clients
    # "performance" for dynamic sampling (notes/fedufo.md reading 11): the global model's accuracy on each client
    # as the fairness metrics measure it ("eval": its local test data, else its distribution-weighted test accuracy;
    # the notes' proposal), or on the client's training data ("train")
    sampling_measure: Literal["eval", "train"] = "eval"
    # re-measure every N rounds (reading 11: every round, or every run.eval_every rounds); the values are
    # checkpointed, so a resumed run samples what the uninterrupted one does
    sampling_refresh: int = Field(1, ge=1)
    # opt-in for tuning (-t train.lr, or -t train.lr=RANGE; docs/tuning.md); sensible defaults: lr over the usual
    # FL grid 1e-3..0.3, momentum up to 0.95, 1-10 local epochs (FedBC E in {1, 5, 10}), 1-100 steps, L2 decay
    tunable: ClassVar[dict[str, str]] = {
        "lr": "log:1e-3:0.3",
        "momentum": "uniform:0:0.95",
        "local_epochs": "int:1:10",
        "local_steps": "int:1:100:log",
        "weight_decay": "log:1e-5:1e-2",
    }

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> TrainSection:
        if self.nesterov and self.momentum == 0:  # torch.optim.SGD refuses it too
            raise ValueError(f"train.nesterov=true needs train.momentum > 0 (got momentum {self.momentum})")
        return self

    @model_validator(mode="after")
    def _settings_of_the_optimizer(self) -> TrainSection:
        """A setting of another optimiser than the one chosen would be silently ignored: refused instead."""
        if self.optimizer != "sgd" and self.momentum:
            raise ValueError(
                f"train.momentum is sgd's; with train.optimizer={self.optimizer!r} the gradient's running mean "
                f"decays by train.beta1 (got momentum {self.momentum}; unset it or use optimizer 'sgd')"
            )
        if self.optimizer == "sgd":
            fields = type(self).model_fields
            changed = [k for k in ("beta1", "beta2", "eps") if getattr(self, k) != fields[k].default]
            if changed:
                given = ", ".join(f"train.{k}={getattr(self, k)} (default {fields[k].default})" for k in changed)
                what = "are settings" if len(changed) > 1 else "is a setting"
                raise ValueError(
                    f"{given} {what} of optimizer 'adam' and 'adamw', and train.optimizer is 'sgd'; "
                    "choose one of them or leave the default"
                )
            if self.optimizer_state == "client" and not self.momentum:
                raise ValueError(
                    "train.optimizer_state='client' keeps the optimiser's state across rounds, and sgd without "
                    "momentum has none; set train.momentum > 0, use optimizer 'adam' or 'adamw', or 'reset'"
                )
        return self


class _Component(Params):
    model_config = ConfigDict(extra="allow")  # the component's own parameters, validated by its registry entry
    name: str

    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class DatasetSection(_Component):
    name: str = "fmnist"  # fedhet list datasets
    # folder that holds (or receives) the files; default $FEDHET_DATA, else the system data folder
    data_dir: str | None = None
    # a class-stratified fraction of the training set, the same for every seed (quick studies on a small machine;
    # the test set stays whole); recorded in provenance.json
    train_fraction: float = Field(1.0, gt=0.0, le=1.0)
    # only these classes, train and test set, relabelled 0, 1, ... in the order given (e.g. pretrain on [0, 1, 2, 3, 4]
    # and fine-tune on [5, 6, 7, 8, 9]); applied before train_fraction; unset = every class
    classes: list[int] | None = None

    @field_validator("data_dir")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        return no_nul(value)

    @field_validator("classes")
    @classmethod
    def _classes(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(value) < 2 or len(set(value)) != len(value) or min(value) < 0):
            raise ValueError("give two or more distinct class indices (0 or more), e.g. [0, 1, 2, 3, 4]")
        return value


class PartitionSection(_Component):
    name: str = "dirichlet"  # fedhet list partitioners
    num_clients: int = Field(20, ge=1)  # clients the training set is split across
    seed: Seed | None = None  # default: run.seed
    local_test_fraction: float = Field(0.0, ge=0.0, lt=1.0)  # FedRANE 0.25, FedBC 0.2
    # validation data: this fraction of each client's training share (after its local test split) is held out, never
    # trained on, and the global model is scored on it at every evaluation (val_acc, val_loss, val_client_acc_*):
    # what tuning reads instead of the test set (docs/tuning.md); 0 = none
    validation_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    # where a client's local test data come from: "split" = local_test_fraction of its own training data; "matched"
    # = the official test set dealt to clients like their training data (each class in proportion to the training
    # samples of it they hold; per-class shards get the same shards of the test set: FedUFO, notes/fedufo.md
    # reading 12), so fairness is measured on test data that follow each client's classes; "natural" = each user's
    # own test samples, for a dataset that ships a per-user test split (synthetic with generator = "fedbc")
    local_test: Literal["split", "matched", "natural"] = "split"
    merge_test: bool = False  # partition train+test together (FedBC's power-law protocol)


class FeaturesSection(_Component):
    # feature skew (data/features.py; fedhet list features): "none", "noise" (NIID-Bench's Gaussian noise of std
    # sigma * i / N on client i), "rotation", "contrast", "invert", "blur" or "colour" (K domains, a transform
    # each; the global test set is scored per domain: test_acc/domain/<k> and .../worst) or "natural" (the
    # dataset's own domain per sample); composes with any partitioner
    name: str = "none"

    @field_validator("name", mode="before")
    @classmethod
    def _none_is_the_name(cls, value: Any) -> Any:
        return "none" if value is None else value  # an override's none parses to None; here it names "none"


class ModelSection(_Component):
    # unset: a model that fits the dataset's input (cnn for images, mlp for digits and synthetic, lstm for
    # shakespeare, logreg for leaf_sent140; models/fit.py), recorded in the run's config.json; fedhet list models
    # shows which fit which
    name: str = "cnn"
    # the initial global model: a fedhet run folder (its last checkpoint's global model), a fedhet checkpoint, a
    # .safetensors file or a torch state dict, matched by tensor name and shape (docs/pretrained.md); its SHA-256 is
    # recorded in provenance.json and a resume refuses a changed file
    init: str | None = Field(None, min_length=1)
    # the head of model.init's or model.pretrained's weights is not used: a fresh one, drawn from the run seed (a
    # head that does not fit the dataset's classes is refused without it)
    replace_head: bool = False

    @field_validator("init")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        return no_nul(value)

    @model_validator(mode="after")
    def _head_of_what(self) -> ModelSection:
        if self.replace_head and self.init is None and self.params().get("pretrained") is None:
            raise ValueError(
                "model.replace_head replaces the head of the weights model.init or model.pretrained gives; set one "
                "of them, or leave replace_head false"
            )
        return self

    # what does not train (docs/pretrained.md): "none" (full training), "body" (linear probing: only the head and
    # any LoRA adapters train) or a list of module names (e.g. ["body.conv1", "body.conv2"]); a frozen parameter gets
    # no gradient, weight decay or momentum, never travels and is never aggregated
    freeze: Literal["none", "body"] | list[str] = "none"
    # LoRA (Hu et al. 2022, through peft): the adapters' rank r; 0 = no LoRA. The adapted layers' own weights freeze
    lora_rank: int = Field(0, ge=0)
    lora_alpha: float | None = Field(None, gt=0.0)  # the update is scaled by alpha / r; None: alpha = r (scale 1)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)  # dropout on the adapters' input (peft's lora_dropout)
    # the layers LoRA adapts, by module name (Linear or Conv2d); None: every Linear layer of the model's body
    lora_targets: list[str] | None = None
    # heterogeneous ranks: client c trains the first lora_ranks[c % len] slots of the rank-lora_rank adapters (the
    # rest masked off); each at most lora_rank. None: every client trains all lora_rank slots
    lora_ranks: list[int] | None = None
    # how lora_ranks are dealt: "client" (cycled over the client ids) or "tier" (lora_ranks[k] for the clients of
    # system tier k: system.profiles = "tiers", one rank per tier)
    lora_ranks_by: Literal["client", "tier"] = "client"

    @field_validator("freeze", mode="before")
    @classmethod
    def _freeze_choice(cls, value: Any) -> Any:
        # one message for the union (pydantic would word each alternative's failure)
        if value in ("none", "body") or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return value
        raise ValueError('must be "none", "body" or a list of module names such as ["body.fc1"]')

    @model_validator(mode="after")
    def _lora_options_need_lora(self) -> ModelSection:
        for key in ("lora_alpha", "lora_dropout", "lora_targets", "lora_ranks"):
            if self.lora_rank == 0 and getattr(self, key) != ModelSection.model_fields[key].default:
                raise ValueError(f"model.{key} applies only with LoRA: set model.lora_rank > 0")
        if self.lora_targets is not None and not self.lora_targets:
            raise ValueError("model.lora_targets must name at least one layer (unset it for the body's Linear layers)")
        ranks = self.lora_ranks
        if self.lora_ranks_by != "client" and ranks is None:
            raise ValueError("model.lora_ranks_by applies only with model.lora_ranks")
        if ranks is not None and (not ranks or not all(1 <= r <= self.lora_rank for r in ranks)):
            raise ValueError(
                f"model.lora_ranks must list client ranks from 1 to model.lora_rank={self.lora_rank} (got {ranks})"
            )
        if isinstance(self.freeze, list) and not self.freeze:
            raise ValueError('model.freeze must name at least one module, or be "none"')
        return self

    def lora(self, train_a: bool = True) -> LoraSpec | None:
        """LoRA's settings, or None without LoRA; ``train_a`` False under FFA-LoRA (server.lora_aggregation)."""
        from fedhet.models.adapt import LoraSpec

        if not self.lora_rank:
            return None
        alpha = float(self.lora_rank) if self.lora_alpha is None else self.lora_alpha
        targets = None if self.lora_targets is None else tuple(self.lora_targets)
        return LoraSpec(self.lora_rank, alpha, self.lora_dropout, targets, train_a)


class AlgorithmSection(_Component):
    name: str = "fedavg"  # fedhet list algorithms


class ServerSection(_Component):
    name: str = "sgd"  # server optimiser; "sgd" with lr 1 is plain averaging
    # How the target model is formed before the server optimiser steps: "weights" is the algorithm's own weighted
    # average; "gne" replaces its weights by FedRANE's Nash-bargaining weights (Liao et al. 2023, algorithms/gne.py),
    # for algorithms whose server takes a weighted average of the client models.
    # "median", "trimmed_mean", "krum", "multikrum" and "geomed" are robust rules on the client deltas
    # (algorithms/robust.py): Yin et al. 2018, Blanchard et al. 2017, RFA (Pillutla et al. 2022)
    aggregation: Literal["weights", "gne", "median", "trimmed_mean", "krum", "multikrum", "geomed"] = "weights"
    # GNE's solver of G^T G p = 1/p: "newton" (the notes' exact convex form) or "ccp" (the paper's Eqs. 15-16)
    gne_solver: Literal["newton", "ccp"] = "newton"
    # GNE's scale: "sum_to_one" (official code), "paper" (paper-literal ||G p||^2 = K; the notes' "none", renamed
    # since an override's none means null), "match_fedavg_norm" (the notes' third option)
    gne_normalize: Literal["sum_to_one", "paper", "match_fedavg_norm"] = "sum_to_one"
    # added to the Frobenius-normalised Gram matrix when its smallest eigenvalue is below it (notes, gotcha 3)
    gne_jitter: float = Field(1e-8, ge=0.0, lt=1.0)
    # trimmed_mean: the share of the largest and of the smallest values dropped per coordinate (beta; ours: 0.1)
    trim_fraction: float = Field(0.1, ge=0.0, lt=0.5)
    # krum / multikrum: f, the Byzantine clients tolerated per round (needs clients per round > 2 f + 2)
    byzantine: int = Field(1, ge=0)
    multikrum_m: int | None = Field(None, ge=1)  # multikrum: the updates averaged; None: clients per round - f
    geomed_iters: int = Field(100, ge=1)  # geomed: at most this many smoothed Weiszfeld iterations (ours)
    geomed_eps: float = Field(1e-6, gt=0.0)  # geomed: nu, the smoothing of the distances (RFA's Algorithm 2)
    # Sun et al. 2019: every client delta scaled to norm at most this before any aggregation rule; None: off
    norm_bound: float | None = Field(None, gt=0.0)
    # "sync": rounds in which the server waits for every sampled client; "fedbuff": FedBuff (Nguyen et al. 2022), on
    # the simulated clock clients train from the model version they downloaded and the server steps every
    # server.buffer_size arrivals (docs/system-heterogeneity.md); a round is then one server step
    mode: Literal["sync", "fedbuff"] = "sync"
    buffer_size: int = Field(10, ge=1)  # fedbuff: K, the updates per server step (the paper's K = 10)
    # fedbuff: the clients training at once, each slot refilled by a uniform draw from the idle clients when its
    # update arrives; None: the clients per round of train.participation / train.clients_per_round
    concurrency: int | None = Field(None, ge=1)
    # fedbuff: the weight of an update that is t - tau server steps stale: "polynomial" (1 + t - tau)^-a, the paper's
    # choice with a = 0.5, or "constant" 1
    staleness: Literal["polynomial", "constant"] = "polynomial"
    staleness_exponent: float = Field(0.5, gt=0.0)  # fedbuff: a in the polynomial weight (the paper's 0.5)
    # how the server aggregates LoRA adapters (model.lora_rank > 0; docs/pretrained.md): "fedit" averages A and B
    # separately like any parameter (FedIT, Zhang et al. 2024); "ffa" keeps every A at its initialisation and
    # averages B (FFA-LoRA, Sun et al. 2024); "flexlora" averages the products B A and splits the average back into
    # rank-r factors by truncated SVD (FlexLoRA, Bai et al. 2024)
    lora_aggregation: Literal["fedit", "ffa", "flexlora"] = "fedit"

    @model_validator(mode="after")
    def _fedbuff_options_need_fedbuff(self) -> ServerSection:
        fields = ServerSection.model_fields
        for key in ("buffer_size", "concurrency", "staleness", "staleness_exponent"):
            if self.mode != "fedbuff" and getattr(self, key) != fields[key].default:
                raise ValueError(f"server.{key} applies only with server.mode='fedbuff' (got mode {self.mode!r})")
        if self.staleness != "polynomial" and self.staleness_exponent != fields["staleness_exponent"].default:
            raise ValueError(
                f"server.staleness_exponent applies only with server.staleness='polynomial' (got {self.staleness!r})"
            )
        return self

    @model_validator(mode="after")
    def _options_need_their_rule(self) -> ServerSection:
        owners = {
            "gne_solver": ("gne",),
            "gne_normalize": ("gne",),
            "gne_jitter": ("gne",),
            "trim_fraction": ("trimmed_mean",),
            "byzantine": ("krum", "multikrum"),
            "multikrum_m": ("multikrum",),
            "geomed_iters": ("geomed",),
            "geomed_eps": ("geomed",),
        }
        for key, rules in owners.items():
            if self.aggregation not in rules and getattr(self, key) != ServerSection.model_fields[key].default:
                wanted = " or ".join(repr(r) for r in rules)
                raise ValueError(
                    f"server.{key} applies only with server.aggregation={wanted} (got {self.aggregation!r})"
                )
        return self


class AttackSection(_Strict):
    """Attacks for evaluation (engine/attack.py): a seeded ``fraction`` of the clients is malicious for the
    whole run (``attack.json`` in the run folder names them). Data attacks change their training batches
    (``label_flip``: y -> C - 1 - y; ``backdoor``: a white square in the bottom-right corner and the ``target`` label
    on a ``poison_fraction`` of each batch), update attacks their replies, as deltas from the received model
    (``sign_flip``: -flip_scale u; ``scale``: scale u; ``gaussian``: N(0, std^2) instead of u)."""

    kind: Literal["none", "label_flip", "sign_flip", "gaussian", "scale", "backdoor"] = "none"
    fraction: float = Field(0.1, gt=0.0, le=1.0)  # share of the clients that are malicious (rounded, at least one)
    flip_scale: float = Field(1.0, gt=0.0)  # sign_flip: the reply's delta is -flip_scale times the honest one
    scale: float = Field(10.0, gt=0.0)  # scale: the delta times this (boosting; ours: 10)
    std: float = Field(1.0, gt=0.0)  # gaussian: the delta is N(0, std^2 I) (ours: 1)
    target: int = Field(0, ge=0)  # backdoor: the label the trigger should produce
    poison_fraction: float = Field(0.5, gt=0.0, le=1.0)  # backdoor: share of each malicious batch that is triggered
    pattern_size: int = Field(3, ge=1)  # backdoor: side in pixels of the white square

    @model_validator(mode="after")
    def _options_need_their_kind(self) -> AttackSection:
        owners = {
            "fraction": ("label_flip", "sign_flip", "gaussian", "scale", "backdoor"),
            "flip_scale": ("sign_flip",),
            "scale": ("scale",),
            "std": ("gaussian",),
            "target": ("backdoor",),
            "poison_fraction": ("backdoor",),
            "pattern_size": ("backdoor",),
        }
        for key, kinds in owners.items():
            if self.kind not in kinds and getattr(self, key) != AttackSection.model_fields[key].default:
                wanted = " or ".join(repr(k) for k in kinds)
                raise ValueError(f"attack.{key} applies only with attack.kind={wanted} (got {self.kind!r})")
        return self


class TrackingSection(_Strict):
    """Optional experiment trackers, each off by default; the run folder stays the record of truth.

    Trackers only receive copies of what the run folder gets (config, metrics, summary) and never change a run's
    numbers, so they may be switched on or off when a run is resumed (``fedhet resume RUN -s tracking.mlflow=true``).
    """

    tensorboard: bool = False  # event files in <run folder>/tensorboard (fedhet[trackers])
    mlflow: bool = False  # a run in the MLflow store at mlflow_uri (fedhet[trackers])
    wandb: bool = False  # a Weights & Biases run in <wandb_dir>/wandb (fedhet[trackers])
    mlflow_uri: str | None = None  # default: sqlite:///<run.out_dir>/mlflow.db, artifacts in <run.out_dir>/mlartifacts
    experiment: str = Field("fedhet", min_length=1)  # MLflow experiment and W&B project
    wandb_dir: str | None = None  # default: <run.out_dir>
    wandb_mode: Literal["offline", "online"] = "offline"  # offline writes a folder that `wandb sync` uploads later

    @field_validator("tensorboard", "mlflow", "wandb")
    @classmethod
    def _installed(cls, value: bool, info: ValidationInfo) -> bool:
        # a config written here to run elsewhere (a Flower app) is checked where it runs
        if value and (info.context or {}).get("runs_here", True):
            from fedhet.results.trackers import check_installed

            check_installed(info.field_name)
        return value

    @field_validator("mlflow_uri", "wandb_dir")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        return no_nul(value)


class PrivacySection(_Strict):
    """Differential privacy (docs/privacy-robustness.md, algorithms/privacy.py). ``central``: client-level
    DP-FedAvg at the server (McMahan et al. 2018), each client's update clipped to ``clip`` and Gaussian noise
    ``noise_multiplier * clip`` on their sum; ``local``: sample-level DP-SGD inside every client's local loop (Abadi
    et al. 2016). Epsilon at ``delta`` is accounted with Google's dp-accounting (the ``privacy`` extra)."""

    # central: client-level DP-FedAvg at the server; local: sample-level DP-SGD in every client's loop
    mode: Literal["none", "central", "local"] = "none"
    clip: float = Field(1.0, gt=0.0)  # C: the L2 bound of a client update (central) or a per-sample gradient (local)
    # z: noise std over C; exactly one of noise_multiplier and target_epsilon (which computes z before round 1)
    noise_multiplier: float | None = Field(None, ge=0.0)
    target_epsilon: float | None = Field(None, gt=0.0)  # central only: reached after run.rounds rounds
    # benchmarks/privacy/'s value; below 1/N for any federation (central) or client (local) of fewer than 1e5 units
    delta: float = Field(1e-5, gt=0.0, lt=1.0)
    # Andrew et al. 2021: the clip follows the target_quantile of the update norms, C <- C exp(-clip_lr (b - q))
    adaptive_clip: bool = False
    target_quantile: float = Field(0.5, ge=0.0, le=1.0)  # gamma; the paper's default 0.5
    clip_lr: float = Field(0.2, gt=0.0)  # eta_C; the paper's geometric step 0.2
    # sigma_b, the noise std on the count of unclipped updates; None: clients per round / 20 (the paper's choice)
    clipped_count_stddev: float | None = Field(None, gt=0.0)

    @model_validator(mode="after")
    def _consistent(self) -> PrivacySection:
        fields = PrivacySection.model_fields
        if self.mode == "none":
            changed = [k for k in fields if k != "mode" and getattr(self, k) != fields[k].default]
            if changed:
                raise ValueError(f"privacy.{changed[0]} applies only with privacy.mode='central' or 'local'")
            return self
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(
                f"privacy.mode={self.mode!r} needs exactly one of privacy.noise_multiplier and target_epsilon"
            )
        if self.mode == "local":
            bad = [k for k in ("target_epsilon", "adaptive_clip") if getattr(self, k) != fields[k].default]
            if bad:
                raise ValueError(
                    f"privacy.{bad[0]} applies only with privacy.mode='central' (local: set noise_multiplier)"
                )
        if not self.adaptive_clip:
            extra = [
                k
                for k in ("target_quantile", "clip_lr", "clipped_count_stddev")
                if getattr(self, k) != fields[k].default
            ]
            if extra:
                raise ValueError(f"privacy.{extra[0]} applies only with privacy.adaptive_clip=true")
        return self


class SystemSection(_Strict):
    """Simulated system heterogeneity (docs/system-heterogeneity.md, engine/system.py): each client's compute speed
    and network, who is online each round, stragglers, a round deadline, dropouts and over-selection, on a simulated
    clock (``sim/time`` in metrics.jsonl). Every draw comes from (run.seed, round, client), so a repeated run and a
    resumed one are bit-identical. With ``profiles = "none"`` (the default) every sampled client is online, finishes
    its work and replies, and no clock runs."""

    # each client's speed and network: "none" (no system model), "constant" (every client speed and bandwidth),
    # "uniform", "lognormal" (around speed and bandwidth, by spread), "tiers" (device tiers) or "trace" (a CSV file)
    profiles: Literal["none", "constant", "uniform", "lognormal", "tiers", "trace"] = "none"
    # samples a client processes per second: every client's (constant), the mean (uniform), the median (lognormal)
    speed: float = Field(100.0, gt=0.0)
    # bytes per second a client moves the model at, each way: every client's, the mean or the median, as speed
    bandwidth: float = Field(1e6, gt=0.0)
    latency: float = Field(0.0, ge=0.0)  # seconds added to every client's round trip
    # uniform: each value uniform in [x (1 - spread), x (1 + spread)], spread < 1; lognormal: x exp(spread N(0, 1)),
    # the standard deviation of the log
    spread: float = Field(0.5, ge=0.0)
    # tiers: [share, speed, bandwidth] per device tier, shares summing to 1; a seeded shuffle gives each tier its
    # share of the clients (rounded; the last tier takes the rest)
    tiers: list[tuple[float, float, float]] = [(0.5, 200.0, 2e6), (0.3, 50.0, 5e5), (0.2, 10.0, 1e5)]
    # profiles = "trace": a CSV file with the header client,speed,bandwidth,availability and one row per client
    # (availability: its probability of being online in a round, read with availability = "trace")
    trace: str | None = None
    # who is online in a round: "always"; "bernoulli" (each client with probability online); "daily" (each client
    # for an online share of every simulated day, from its own seeded start); "trace" (the trace's availability)
    availability: Literal["always", "bernoulli", "daily", "trace"] = "always"
    online: float = Field(0.8, ge=0.0, le=1.0)  # bernoulli: probability online; daily: the online share of a day
    day: float = Field(86400.0, gt=0.0)  # daily: simulated seconds per day
    # FedProx's stragglers: this fraction of a round's sampled clients (rounded) does a uniformly random number of
    # local steps in [1, its full count]
    stragglers: float = Field(0.0, ge=0.0, le=1.0)
    # what happens to a straggler's or a late client's work: "drop" it (FedAvg's practice in the FedProx paper) or
    # keep the "partial" work (what fits before the deadline)
    straggler_policy: Literal["drop", "partial"] = "drop"
    # a straggler's work: "uniform" local steps in [1, its full count], or "epochs", a uniform whole number of epochs
    # in [1, train.local_epochs - 1] (FedProx's code: randint(1, E)), which needs whole train.local_epochs >= 2
    straggler_steps: Literal["uniform", "epochs"] = "uniform"
    # simulated seconds a round lasts at most: a client whose reply would arrive later is dropped, or sends the steps
    # that fit (straggler_policy = "partial"); None: the round waits for every reply
    deadline: float | None = Field(None, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, le=1.0)  # probability that a client fails after training, before replying
    # sample clients per round x (1 + over_selection) (rounded up) and keep the first replies to arrive, at most
    # clients per round (Bonawitz et al. 2019)
    over_selection: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _consistent(self) -> SystemSection:
        fields = SystemSection.model_fields
        changed = [k for k in fields if getattr(self, k) != fields[k].default]
        if self.profiles == "none":
            if [k for k in changed if k != "profiles"]:
                key = next(k for k in changed if k != "profiles")
                raise ValueError(
                    f"system.{key} needs a system model: set system.profiles to one of constant, uniform, lognormal, "
                    "tiers, trace"
                )
            return self
        owners = {
            "speed": ("constant", "uniform", "lognormal"),
            "bandwidth": ("constant", "uniform", "lognormal"),
            "spread": ("uniform", "lognormal"),
            "tiers": ("tiers",),
            "trace": ("trace",),
        }
        for key, kinds in owners.items():
            if key in changed and self.profiles not in kinds:
                wanted = " or ".join(repr(k) for k in kinds)
                raise ValueError(f"system.{key} applies only with system.profiles={wanted} (got {self.profiles!r})")
        if self.profiles == "uniform" and self.spread >= 1:
            raise ValueError(f"system.spread must be below 1 with profiles='uniform' (got {self.spread})")
        if self.profiles == "trace" and not self.trace:
            raise ValueError("system.profiles='trace' needs system.trace, the CSV file of the clients' profiles")
        if self.availability == "trace" and self.profiles != "trace":
            raise ValueError("system.availability='trace' needs system.profiles='trace' (the trace's availability)")
        extra = {"online": ("bernoulli", "daily"), "day": ("daily",)}
        for key, kinds in extra.items():
            if key in changed and self.availability not in kinds:
                wanted = " or ".join(repr(k) for k in kinds)
                raise ValueError(f"system.{key} applies only with system.availability={wanted}")
        if "straggler_policy" in changed and not (self.stragglers or self.deadline):
            raise ValueError("system.straggler_policy applies only with system.stragglers > 0 or system.deadline")
        if "straggler_steps" in changed and not self.stragglers:
            raise ValueError("system.straggler_steps applies only with system.stragglers > 0")
        return self

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, value: list[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
        if not value:
            raise ValueError("needs at least one tier [share, speed, bandwidth]")
        for i, (share, speed, bandwidth) in enumerate(value):
            if not (share > 0 and speed > 0 and bandwidth > 0):
                raise ValueError(f"tier {i} [{share}, {speed}, {bandwidth}]: share, speed and bandwidth must be > 0")
        total = sum(t[0] for t in value)
        if abs(total - 1.0) > 1e-9:
            raise ValueError(f"the tiers' shares must sum to 1 (they sum to {total:g})")
        return value

    @field_validator("trace")
    @classmethod
    def _path(cls, value: str | None) -> str | None:
        return no_nul(value)

    @property
    def active(self) -> bool:
        """Whether a system model runs (``profiles`` other than "none")."""
        return self.profiles != "none"


# path bytes kept free under a run folder for the files written in it (checkpoints/.ckpt-XXXXXXXX.tmp, ...)
RUN_FILES_RESERVE = 64


def with_model_tokenizer(data: dict[str, Any], dataset: str, params: dict[str, Any], model: Any) -> dict[str, Any]:
    """An hf text dataset for a model with ``pretrained`` weights whose folder has a tokenizer is tokenised by it
    (``dataset.tokenizer``, unless one is given), so the ids are the ones the pretrained embedding learnt."""
    pretrained = model.get("pretrained") if isinstance(model, dict) else None
    if dataset != "hf" or params.get("task") != "text" or "tokenizer" in params or not isinstance(pretrained, str):
        return data
    if not isinstance(data.get("dataset"), dict):
        return data
    from fedhet.models.hub import tokenizer_of

    found = tokenizer_of(pretrained)
    return data if found is None else {**data, "dataset": {**data["dataset"], "tokenizer": found}}


class Config(_Strict):
    run: RunSection = RunSection()
    dataset: DatasetSection = DatasetSection()
    partition: PartitionSection = PartitionSection()
    features: FeaturesSection = FeaturesSection()
    model: ModelSection = ModelSection()
    train: TrainSection = TrainSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    server: ServerSection = ServerSection()
    tracking: TrackingSection = TrackingSection()
    attack: AttackSection = AttackSection()
    privacy: PrivacySection = PrivacySection()
    system: SystemSection = SystemSection()

    @model_validator(mode="before")
    @classmethod
    def _model_fits_the_data(cls, data: Any) -> Any:
        # model.name unset: the model that fits the dataset (models/fit.py); an explicit one always wins
        if not isinstance(data, dict):
            return data
        dataset, model = data.get("dataset"), data.get("model")
        name = dataset.get("name", "fmnist") if isinstance(dataset, dict) else getattr(dataset, "name", "fmnist")
        if not isinstance(name, str):
            return data  # refused with the dataset section's own message
        from fedhet.models.fit import default_model

        params = dataset if isinstance(dataset, dict) else dataset.params() if isinstance(dataset, _Component) else {}
        data = with_model_tokenizer(data, name, params, model)
        if model is None:
            return {**data, "model": {"name": default_model(name, params)}}
        if isinstance(model, dict) and "name" not in model:
            return {**data, "model": {"name": default_model(name, params), **model}}
        if isinstance(model, ModelSection) and "name" not in model.model_fields_set:
            return {**data, "model": {"name": default_model(name, params), **model.params()}}
        return data

    @model_validator(mode="after")
    def _check(self) -> Config:
        n = self.partition.num_clients
        part = self.partition
        if part.local_test != "split" and (part.local_test_fraction > 0 or part.merge_test):
            raise ValueError(
                f"partition.local_test={part.local_test!r} takes the clients' test data from the official test set; "
                "it cannot be combined with partition.local_test_fraction > 0 or partition.merge_test "
                "(use local_test='split')"
            )
        if part.local_test == "natural" and part.name != "natural":
            raise ValueError(
                f"partition.local_test='natural' gives each user its own test samples, so it needs "
                f"partition.name='natural', not {part.name!r}"
            )
        if self.train.clients_per_round is not None and self.train.clients_per_round > n:
            raise ValueError(
                f"train.clients_per_round={self.train.clients_per_round} exceeds partition.num_clients={n}"
            )
        if self.model.lora_ranks_by == "tier":
            tiers = self.system.tiers
            if self.system.profiles != "tiers" or len(tiers) != len(self.model.lora_ranks or []):
                raise ValueError(
                    f"model.lora_ranks_by='tier' gives each device tier a rank: it needs system.profiles='tiers' and "
                    f"one rank per tier in model.lora_ranks ({len(tiers)} tiers, {len(self.model.lora_ranks or [])} "
                    "ranks)"
                )
        if self.server.lora_aggregation != "fedit" and not self.model.lora_rank:
            raise ValueError(
                f"server.lora_aggregation={self.server.lora_aggregation!r} aggregates LoRA adapters; "
                "set model.lora_rank"
            )
        from fedhet.models.fit import misfit

        wrong = misfit(self.model.name, self.model.params(), self.dataset.name, self.dataset.params())
        if wrong:
            raise ValueError(wrong)
        return self

    @model_validator(mode="after")
    def _run_folder_fits(self, info: ValidationInfo) -> Config:
        # run.out_dir/run.name is made as a folder: a name longer than its file system allows (OSError: File name
        # too long, deep in the run) is refused here; for a config that runs elsewhere, against the common limits
        from fedhet.paths import limits, name_problem, quoted

        here = (info.context or {}).get("runs_here", True)
        out_dir = self.run.out_dir
        problem = name_problem(out_dir, here)
        if problem:
            raise ValueError(f"run.out_dir {quoted(out_dir)} {problem}")
        # the derived name's length without resolving its components (that loads plug-ins): its hash is fixed-size
        name = self.run.name or self.legacy_name() + "-" + "0" * NAME_HASH_CHARS
        name_max, _ = limits(out_dir, here)
        size = len(os.fsencode(name))
        if size > name_max:
            setting = "run.name" if self.run.name else "the run's name (derived from the components; set run.name)"
            raise ValueError(
                f"{setting} {shown(name, 40)} is {size} bytes long; the file system of run.out_dir "
                f"{quoted(os.path.abspath(out_dir))} allows at most {name_max} bytes per folder name (PC_NAME_MAX)"
            )
        problem = name_problem(Path(out_dir) / name, here, reserve=RUN_FILES_RESERVE)
        if problem:
            raise ValueError(f"the run folder {quoted(Path(out_dir) / name)} {problem}")
        return self

    def clients_per_round(self) -> int:
        if self.train.clients_per_round is not None:
            return self.train.clients_per_round
        return max(1, round(self.train.participation * self.partition.num_clients))

    def legacy_name(self) -> str:
        """The readable part of the derived name, and all of it before fedhet told settings apart by a hash:
        ``scaffold-fmnist-dirichlet-s0``."""
        return f"{self.algorithm.name}-{self.dataset.name}-{self.partition.name}-s{self.run.seed}"

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# an unknown component key's message lists the section's own keys first (registry.py never imports the config)
section_keys({section: field.annotation.model_fields for section, field in Config.model_fields.items()})

# hex characters of the settings hash in a derived run name (32 bits: a collision needs ~65k configs in one folder)
NAME_HASH_CHARS = 8
# What a resumed run may change: how far it goes and how it reports, never what the rounds so far computed.
# run.executor and run.workers change only float rounding (a resume under another thread count or executor warns that
# the run is then not bit-exact).
RESUMABLE_CHANGES = (
    "run.rounds",
    "run.progress",
    "run.checkpoint_every",
    "run.max_empty_rounds",
    "run.workers",
    "run.executor",
    "run.max_group",
    "run.compile",
    "run.client_metrics",  # whether client_metrics.jsonl is written: a copy of what the clients reported
)


def format_validation_error(err: ValidationError) -> str:
    """One line: each problem ('train.lr: must be greater than 0 (got -1)'), then, for unknown keys, the valid keys of
    each section they were found in."""
    problems, hints, close = [], {}, []
    for e in err.errors():
        if e["type"] != "extra_forbidden":
            problems.append(problem(e))
        elif len(e["loc"]) == 1:
            problems.append(f"unknown section {shown(e['loc'][0])}")
            hints[""] = f"valid sections: {', '.join(Config.model_fields)}"
            close.append(suggestion(str(e["loc"][0]), list(Config.model_fields)))
        else:
            section, key = e["loc"][0], ".".join(str(p) for p in e["loc"])
            problems.append(f"unknown key {shown(key)}")
            keys = Config.model_fields[section].annotation.model_fields
            hints[section] = f"valid keys in [{section}]: {', '.join(keys)}"
            close.append(suggestion(key.split(".", 1)[1], keys, f"{section}."))
    return "; ".join([*problems, *hints.values()]) + "".join(close)


def parse_value(text: str) -> Any:
    """Parse an override value: numbers, booleans, lists and quoted strings as Python literals, else a string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return text


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.key=value")
    key, value = assignment.split("=", 1)
    set_dotted(raw, key, parse_value(value))


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """``raw["train"]["lr"] = value`` for ``key = "train.lr"``, creating sections as needed."""
    parts = [part.strip() for part in key.strip().split(".")]
    if len(parts) < 2:
        raise ConfigError(f"override key {key!r} must name a section, e.g. train.lr=0.05")
    if not all(parts):
        raise ConfigError(f"override key {key!r} has an empty part; write section.key=value, e.g. train.lr=0.05")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
    node[parts[-1]] = value


# a config file is a few kB; anything over this is not one (and is refused before it is read)
MAX_CONFIG_BYTES = 1_000_000


def load_raw(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    from fedhet.paths import check_input_file

    # a regular file of sane size, checked before it is opened: a FIFO would hang, /dev/zero fill the memory
    p = check_input_file(path, "config file", max_bytes=MAX_CONFIG_BYTES, noun="TOML file")
    name = shown(str(p), 200)
    try:
        with p.open("rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"config file {name} cannot be read: {err.strerror or err}") from None
    if len(data) > MAX_CONFIG_BYTES:  # it grew since it was checked
        raise ConfigError(f"config file {name} is larger than a TOML file may be ({MAX_CONFIG_BYTES} bytes)")
    try:
        text = data.decode("utf-8-sig")  # TOML is UTF-8; a byte-order mark from an editor is harmless
    except UnicodeDecodeError as err:
        bad = shown(data[err.start : err.start + 4])
        raise ConfigError(f"config file {name} is not UTF-8 text (byte {err.start}: {bad})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {name} is not valid TOML: {' '.join(str(err).split())}") from None


def plugins_from_file(raw: dict[str, Any], path: str | Path | None) -> dict[str, Any]:
    """``raw`` with the plug-in files its TOML file names (``run.plugins``) taken relative to that file's folder, so
    a config and its plug-in can move together (a Flower app folder)."""
    from fedhet.plugins import normalise

    run = raw.get("run")
    specs = run.get("plugins") if isinstance(run, dict) else None
    if path is None or not isinstance(specs, list) or not all(isinstance(s, str) and s.strip() for s in specs):
        return raw  # nothing to place, or a wrong value that validation words
    run["plugins"] = [normalise(spec, Path(path).resolve().parent) for spec in specs]
    return raw


def build_config(raw: dict[str, Any], *, runs_here: bool = True) -> Config:
    """The validated config; ``runs_here=False`` for one that runs on other machines (a Flower app folder), whose
    ``run.device`` is then only checked to be a device name, not to be present here."""
    try:
        return Config.model_validate(raw, context={"runs_here": runs_here})
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, runs_here: bool = True
) -> Config:
    raw = plugins_from_file(load_raw(path), path)
    raw.pop("compare", None)  # a comparison's variant list; `fedhet run` on such a file runs its base setting
    for item in overrides or []:
        apply_override(raw, item)
    return build_config(raw, runs_here=runs_here)


def read_saved_config(saved: Path) -> dict[str, Any]:
    """A run folder's ``config.json`` as the run saved it: a JSON object whose ``run`` is an object. Anything else (a
    config.json of some other program in the folder) is one ConfigError naming the file, raised by ``fedhet resume``
    and ``--resume`` alike before either touches the folder."""
    try:
        raw = json.loads(saved.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{saved}: unreadable ({err})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("run"), dict):
        raise ConfigError(f"{saved}: not a fedhet run config")
    return raw


def saved_run_config(run_dir: str | Path, overrides: list[str] | None = None) -> Config:
    """The config a run folder was started with, placed where the folder is now (it may have been moved)."""
    from fedhet.paths import check_folder

    folder = check_folder(run_dir, "run folder", must_exist=True)  # not a file, FIFO, dangling link or too long
    saved = folder / "config.json"
    if not saved.is_file():
        raise ConfigError(f"{str(folder)!r} is not a run folder: it has no config.json")
    raw = read_saved_config(saved)
    raw["run"].update(out_dir=str(folder.resolve().parent), name=folder.resolve().name)
    for item in overrides or []:
        apply_override(raw, item)
    return build_config(raw)
