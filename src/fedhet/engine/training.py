"""What a run trains with, built from its config: the resolved config, the federation, the model and algorithm, the
client runner and the worker count. Both executors (in-process and worker processes) and every Flower node build
theirs here, below the round loop (``engine/simulation.py``), so nothing here imports the loop."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from fedhet import plugins
from fedhet.algorithms import ALGORITHMS, Algorithm, Setup, build_server_optimizer
from fedhet.algorithms.base import AlgoConfig
from fedhet.algorithms.gne import GNE
from fedhet.algorithms.robust import RULES as ROBUST_RULES
from fedhet.algorithms.robust import RobustAggregator
from fedhet.components import component_registries
from fedhet.config import RESUMABLE_CHANGES, Config
from fedhet.data.augment import build_augment
from fedhet.data.federated import FederatedDataset, federate
from fedhet.data.partition_file import SavedPartition, fingerprint
from fedhet.data.types import ArrayDataset
from fedhet.engine.attack import Attack
from fedhet.engine.buffered import check_fedbuff
from fedhet.engine.client import ClientRunner
from fedhet.engine.initial import InitialWeights, initial_weights, load_into
from fedhet.engine.system import client_lora_ranks
from fedhet.errors import ConfigError
from fedhet.toolkit.flat import FlatModel
from fedhet.toolkit.local import derive_seed, num_local_steps


def resolve_config(cfg: Config) -> dict[str, Any]:
    """Validate every component's parameters against its registry entry and return the config with all defaults.

    This runs before any data is loaded, so a wrong name or value fails in a second, not after a download. The run's
    plug-ins are loaded first, so their components are found here as built-in ones are.
    """
    plugins.load(cfg.run.plugins)
    out = cfg.to_dict()
    for section, registry in component_registries():
        comp = getattr(cfg, section)
        entry, parsed = registry.parse(comp.name, comp.params())
        params = parsed.model_dump(mode="json") if parsed is not None else {}
        fixed = {k: v for k, v in out[section].items() if k not in comp.params()}
        out[section] = {**fixed, "name": entry.name, **params}
    check_aggregation(cfg)
    check_lora(cfg)
    check_privacy(cfg)
    check_system(cfg)
    check_optimizer(cfg)
    check_fedbuff(cfg)
    if cfg.attack.kind != "none" and ALGORITHMS.get(cfg.algorithm.name).obj.pools_clients:
        raise ConfigError(
            f"attack.kind={cfg.attack.kind!r} makes some clients malicious, and {cfg.algorithm.name} trains one client "
            "holding every client's data; attack a federated method"
        )
    return out


def check_aggregation(cfg: Config) -> None:
    """``server.aggregation`` other than "weights", and ``server.norm_bound``, only for algorithms whose server
    takes a weighted average of client models; Krum's f must leave it neighbours among the clients of a round."""
    server = cfg.server
    if server.aggregation == "weights" and server.norm_bound is None:
        return
    entry = ALGORITHMS.get(cfg.algorithm.name)
    what = "server.norm_bound" if server.aggregation == "weights" else f"server.aggregation={server.aggregation!r}"
    if not entry.obj.accepts_gne():
        able = [e.name for e in ALGORITHMS.entries() if e.obj.accepts_gne()]
        raise ConfigError(
            f"{what} replaces a weighted average of client models, which "
            f"{entry.name}'s server does not take; algorithms that accept it: {', '.join(able)}"
        )
    n = cfg.clients_per_round()
    if server.aggregation in ("krum", "multikrum") and n <= 2 * server.byzantine + 2:
        raise ConfigError(
            f"server.aggregation={server.aggregation!r} with server.byzantine={server.byzantine} needs more than "
            f"2 f + 2 = {2 * server.byzantine + 2} clients per round, and the run has {n} "
            f"(lower server.byzantine to at most {max((n - 3) // 2, 0)} or raise train.clients_per_round)"
        )
    if server.aggregation == "multikrum" and server.multikrum_m is not None and server.multikrum_m > n:
        raise ConfigError(f"server.multikrum_m={server.multikrum_m} exceeds the {n} clients per round")


def check_lora(cfg: Config) -> None:
    """An algorithm that splits the model at its head (``Algorithm.head_refusal``) is refused a frozen or adapted
    head. ``server.lora_aggregation = "flexlora"`` and heterogeneous ranks (``model.lora_ranks``) replace the
    adapters' part of a plain weighted average of client models (``Algorithm.lora``), so they need one, formed from
    every reply of a synchronous round; FlexLoRA's SVD factors also need the server to take that target as it is."""
    model = cfg.model
    algo = ALGORITHMS.get(cfg.algorithm.name).obj
    for key, names in (("freeze", model.freeze), ("lora_targets", model.lora_targets)):
        touched = [n for n in names or [] if n == "head" or n.startswith("head.")] if isinstance(names, list) else []
        if touched and algo.head_refusal:
            split = ", ".join(e.name for e in ALGORITHMS.entries() if e.obj.head_refusal)
            raise ConfigError(
                f"model.{key} names the head ({touched[0]!r}), and {algo.name} {algo.head_refusal}; leave the head "
                f"out of model.{key} or choose an algorithm other than {split}"
            )
    flex = cfg.server.lora_aggregation == "flexlora"
    if not flex and model.lora_ranks is None:
        return
    server = cfg.server
    what = "server.lora_aggregation='flexlora'" if flex else "model.lora_ranks"
    entry = ALGORITHMS.get(cfg.algorithm.name)
    if not entry.obj.accepts_gne():
        able = [e.name for e in ALGORITHMS.entries() if e.obj.accepts_gne()]
        raise ConfigError(
            f"{what} changes how the weighted average of the client models treats their adapters, which "
            f"{entry.name}'s server does not take; algorithms that accept it: {', '.join(able)}"
        )
    if server.aggregation != "weights" or server.norm_bound is not None or cfg.privacy.mode == "central":
        other = (
            "privacy.mode='central'"
            if cfg.privacy.mode == "central"
            else f"server.aggregation={server.aggregation!r}"
            if server.aggregation != "weights"
            else "server.norm_bound"
        )
        raise ConfigError(
            f"{what} forms the adapters from each client's own with the algorithm's weights; unset {other}"
        )
    if server.mode != "sync":
        raise ConfigError(f"{what} needs each round's replies at once; use server.mode='sync'")
    if flex and (server.name != "sgd" or server.params().get("lr", 1.0) != 1.0):
        raise ConfigError(
            f"{what} re-factors the adapters by SVD every round, so their coordinates do not persist from round to "
            "round for a server optimiser's state; use server.name='sgd' with lr=1"
        )


def check_optimizer(cfg: Config) -> None:
    """``train.optimizer`` only with an algorithm whose math holds for it (``Algorithm.optimizer_refusal``)."""
    algo_cls, algo_cfg = algorithm_config(cfg)
    problem = algo_cls.optimizer_refusal(algo_cfg, cfg.train)
    if problem:
        raise ConfigError(f"train.optimizer={cfg.train.optimizer!r}: {problem}")


def check_system(cfg: Config) -> None:
    """[system] where the system model means something: a federation of clients, and a central DP accountant whose
    sampling assumption (m of the N clients uniformly each round) still holds. Stragglers, the deadline and dropouts
    only remove replies, which DP-FedAvg's fixed denominator m already allows for (docs/system-heterogeneity.md)."""
    system = cfg.system
    if not system.active:
        return
    train = cfg.train
    epochs_ok = train.local_steps is None and float(train.local_epochs).is_integer() and train.local_epochs >= 2
    if system.straggler_steps == "epochs" and not epochs_ok:
        given = (
            f"train.local_steps={train.local_steps}"
            if train.local_steps
            else f"train.local_epochs={train.local_epochs:g}"
        )
        raise ConfigError(
            "system.straggler_steps='epochs' draws a straggler's whole epochs in [1, train.local_epochs - 1], which "
            f"needs a whole train.local_epochs >= 2 and no train.local_steps (got {given}); or use 'uniform'"
        )
    algo = ALGORITHMS.get(cfg.algorithm.name).obj
    if algo.pools_clients:
        raise ConfigError(
            f"system.profiles={system.profiles!r} models the federation's clients, and {algo.name} trains one client "
            "holding every client's data; use system.profiles='none'"
        )
    if cfg.privacy.mode == "central":
        changed = "system.over_selection" if system.over_selection else None
        if system.availability != "always":
            changed = f"system.availability={system.availability!r}"
        if changed:
            raise ConfigError(
                f"privacy.mode='central' is accounted for m of the N clients drawn uniformly each round, and {changed} "
                "draws them otherwise; use system.availability='always' and system.over_selection=0"
            )


def check_privacy(cfg: Config) -> None:
    """[privacy] only where its guarantee holds: the accountant's sampling, an aggregation it can privatise (central)
    or a loss it can take per sample (local)."""
    mode = cfg.privacy.mode
    if mode == "none":
        return
    if cfg.train.sampling != "uniform":
        raise ConfigError(
            f"privacy.mode={mode!r} is accounted for clients drawn uniformly without replacement; "
            f"train.sampling={cfg.train.sampling!r} picks them from their results (use train.sampling='uniform')"
        )
    algo = ALGORITHMS.get(cfg.algorithm.name).obj
    if algo.pools_clients:
        raise ConfigError(f"privacy.mode={mode!r} protects clients; {algo.name} pools their data into one client")
    if mode == "central":
        if cfg.server.aggregation != "weights":
            raise ConfigError(
                f"privacy.mode='central' fixes DP-FedAvg's uniform weights over clipped updates; it cannot be combined "
                f"with server.aggregation={cfg.server.aggregation!r} (use 'weights')"
            )
        if cfg.server.norm_bound is not None:
            raise ConfigError(
                "privacy.mode='central' already bounds every update's norm by privacy.clip; unset server.norm_bound"
            )
        if not algo.accepts_central_dp():
            able = ", ".join(e.name for e in ALGORITHMS.entries() if e.obj.accepts_central_dp())
            if algo.accepts_gne():  # a weighted average, but not the only thing its server takes from the clients
                raise ConfigError(
                    f"privacy.mode='central' privatises the weighted average of the client models only, and "
                    f"{algo.name}'s server also uses {algo.central_dp_unprivatised}, which would reach it "
                    f"unprivatised; algorithms that accept it: {able}"
                )
            raise ConfigError(
                f"privacy.mode='central' privatises a weighted average of client models, which {algo.name}'s server "
                f"does not take; algorithms that accept it: {able}"
            )
    elif not algo.__dict__.get("dp_sgd", False):
        able = [e.name for e in ALGORITHMS.entries() if e.obj.__dict__.get("dp_sgd", False)]
        raise ConfigError(
            f"privacy.mode='local' needs a per-sample local loss and no other use of the client's data, which "
            f"{algo.name} does not declare (dp_sgd); algorithms that accept it: {', '.join(able)}"
        )


def attach_privacy(cfg: Config, algo: Algorithm, flat: FlatModel, fed: FederatedDataset) -> None:
    """The server half of [privacy]: DP-FedAvg's clipped noised mean, or local DP-SGD's per-client ledger."""
    from fedhet.algorithms.privacy import CentralDP, LocalDP

    mode = cfg.privacy.mode
    if mode == "none":
        return
    if flat.buffers.numel():
        raise ConfigError(
            f"privacy.mode={mode!r}: model {cfg.model.name!r} has buffers (BatchNorm statistics), which would be "
            "averaged without privacy; use a model without them (e.g. resnet18 with norm='group')"
        )
    if mode == "central":
        per_round = cfg.clients_per_round()
        algo.privacy = CentralDP(cfg.privacy, fed.num_clients, per_round, cfg.run.rounds, cfg.run.seed)
        # the local steps of a client of the federation's mean size: a public scale (SCAFFOLD's control variates)
        t = cfg.train
        mean_size = int(round(float(fed.train_counts.sum()) / max(fed.num_clients, 1)))
        algo.privacy.mean_steps = num_local_steps(mean_size, t.batch_size, t.local_epochs, t.local_steps)
    else:
        algo.privacy = LocalDP(cfg.privacy, cfg.train.batch_size)


def load_data(cfg: Config) -> ArrayDataset:
    """The dataset a config names, with its classes (``dataset.classes``) and training subset
    (``dataset.train_fraction``)."""
    from fedhet.data.datasets import load_dataset
    from fedhet.models.fit import loaded_misfit

    plugins.load(cfg.run.plugins)  # a Flower node builds its data here without resolving the config first
    ds = load_dataset(cfg.dataset.name, cfg.dataset.data_dir, **cfg.dataset.params())
    ds = ds.class_subset(cfg.dataset.classes).train_subset(cfg.dataset.train_fraction)
    wrong = loaded_misfit(cfg.model.name, cfg.model.params(), cfg.dataset.name, cfg.dataset.params(), ds)
    if wrong:  # known only now, with the data: a Hugging Face dataset's task "auto" found a table, not images
        raise ConfigError(wrong)
    return ds


def partition_of(cfg: Config, ds: ArrayDataset) -> SavedPartition:
    """The clients' index sets of ``cfg`` over ``ds``: what the partitioner gives (or a partition file holds), and the
    local test sets dealt from the official test set; with the dataset's fingerprint, as a partition file saves it
    (``made_by`` is filled in by ``to_save``)."""
    from fedhet.data.partition import partition

    p = cfg.partition
    seed = cfg.run.seed if p.seed is None else p.seed
    labels, groups = ds.y_train, ds.groups_train
    if p.merge_test:
        labels = np.concatenate([ds.y_train, ds.y_test])
        if groups is not None and ds.groups_test is not None:
            groups = np.concatenate([groups, ds.groups_test])
    current = fingerprint(ds, labels, cfg.dataset.train_fraction, p.merge_test, cfg.dataset.classes)
    saved = None
    if p.name == "file":  # the data must be those it was made from before its indices mean anything
        saved = SavedPartition.load(p.params()["path"])
        saved.check_dataset(current)
    parts = partition(p.name, labels, p.num_clients, seed, groups=groups, **p.params())
    test_parts = saved_tests(cfg, ds, saved) if saved is not None else None
    if test_parts is None:
        test_parts = local_tests(cfg, ds, parts, groups, seed)
    return SavedPartition(parts, test_parts, current, saved.made_by if saved else {}, saved.path if saved else None)


def local_tests(cfg: Config, ds: ArrayDataset, parts, groups, seed: int) -> list[np.ndarray] | None:
    """Each client's local test set from the official test set (``partition.local_test`` "matched" or "natural"), or
    None ("split": a share of its own data, cut when the clients are built)."""
    from fedhet.data.partition import label_counts, match_test, natural_test

    local_test = cfg.partition.local_test
    if local_test == "matched":
        if not ds.has_test_set:
            raise ConfigError(f"partition.local_test='matched' needs a test set, and {ds.name!r} has none; use 'split'")
        counts = label_counts(ds.y_train, parts, ds.num_classes)
        return match_test(ds.y_test, counts, np.random.default_rng([seed, 0x7E5]))
    if local_test == "natural":
        if ds.groups_test is None or not ds.has_test_set:
            raise ConfigError(
                f"partition.local_test='natural' needs a dataset with a per-user test split, and {ds.name!r} has "
                "none (synthetic with dataset.generator='fedbc' has one); use 'split'"
            )
        return natural_test(groups, parts, ds.groups_test)
    return None


def saved_tests(cfg: Config, ds: ArrayDataset, saved: SavedPartition) -> list[np.ndarray] | None:
    """A partition file's local test sets, used as they are (None when it has none: partition.local_test decides)."""
    test_parts = saved.test_parts(len(ds.y_test), bool(cfg.partition.params().get("allow_overlap", False)))
    if test_parts is not None and cfg.partition.local_test_fraction > 0:
        raise ConfigError(
            f"{saved.where} holds each client's local test samples from the official test set; set "
            "partition.local_test_fraction=0 to use them"
        )
    return test_parts


def to_save(cfg: Config, split: SavedPartition) -> SavedPartition:
    """``split`` with the settings it came from (those of the file it was read from, for a partition file)."""
    if split.made_by:
        return split
    from fedhet import __version__

    resolved = resolve_config(cfg)
    p = cfg.partition
    made_by = {
        "dataset": resolved["dataset"],
        "partition": resolved["partition"],
        "seed": cfg.run.seed if p.seed is None else p.seed,
        "fedhet": __version__,
    }
    return SavedPartition(split.train, split.test, split.dataset, made_by)


def build_federation(
    cfg: Config, ds: ArrayDataset | None = None, split: SavedPartition | None = None
) -> FederatedDataset:
    """The clients' tensors of ``cfg``; ``ds`` and ``split`` (``load_data``, ``partition_of``) when already made."""
    from fedhet.data.features import feature_skew

    ds = load_data(cfg) if ds is None else ds
    split = partition_of(cfg, ds) if split is None else split
    p = cfg.partition
    fed = federate(
        ds,
        split.train,
        local_test_fraction=p.local_test_fraction,
        validation_fraction=p.validation_fraction,
        merged=p.merge_test,
        seed=cfg.run.seed if p.seed is None else p.seed,
        device=cfg.run.device,
        test_parts=split.test,
        skew=feature_skew(cfg.features.name, ds, p.num_clients, **cfg.features.params()),
    )
    if split.path is not None:  # a partition file: its indices are part of what the run trains on
        digest = hashlib.sha256(Path(split.path).read_bytes()).hexdigest()
        fed.provenance = {**(fed.provenance or {}), "partition_file": str(split.path), "partition_sha256": digest}
    return fed


def algorithm_config(cfg: Config) -> tuple[type[Algorithm], AlgoConfig]:
    """The algorithm class named in ``cfg`` and its validated hyper-parameters."""
    entry, params = ALGORITHMS.parse(cfg.algorithm.name, cfg.algorithm.params())
    return entry.obj, params


def build_algorithm(cfg: Config, setup: Setup) -> Algorithm:
    algo_cls, algo_cfg = algorithm_config(cfg)
    algo = algo_cls(algo_cfg, setup, build_server_optimizer(cfg.server.name, cfg.server.params()))
    server = cfg.server
    if server.aggregation == "gne":
        algo.use_gne(GNE(server.gne_solver, server.gne_normalize, server.gne_jitter))
    if server.aggregation in ROBUST_RULES or server.norm_bound is not None:
        algo.robust = RobustAggregator(
            server.aggregation,
            server.norm_bound,
            server.trim_fraction,
            server.byzantine,
            server.multikrum_m,
            server.geomed_eps,
            server.geomed_iters,
        )
    return algo


# Trackers get copies of what the run folder gets; switching one on or off never changes the numbers. Runs saved
# before [tracking] existed lack these keys: they count as unchanged too.
RESUMABLE_SECTIONS = ("tracking.",)
# Where the run folder is: a moved or copied run folder stays resumable.
LOCATION = ("run.out_dir", "run.name")
# Where the plug-in files are (a moved folder may take its plug-in along): the components they provide are compared
# by name and parameters like any other, and a missing plug-in is an error when the resumed run loads it.
PLUGIN_PATHS = ("run.plugins",)


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The settings (as "section.key: old -> new") that forbid resuming a run saved with ``saved``.

    A component parameter the saved config lacks counts as unchanged while it holds its default: it was added after
    the run was saved, and a new parameter's default keeps the behaviour it had before. An unset ``partition.seed``
    is the run seed (``build_federation``), so setting it to that value changes nothing either."""
    from fedhet.results.report import flatten

    old, new = flatten(saved), flatten(current)
    for flat in (old, new):
        if flat.get("partition.seed") is None and "run.seed" in flat:
            flat["partition.seed"] = flat["run.seed"]
    # A setting that a saved config predates ran with its default (a section field such as server.aggregation, a
    # component parameter such as algorithm.evaluate), so a run from before it was added still resumes.
    defaults = {**flatten(Config.model_construct().to_dict()), **component_defaults(current)}
    keys = sorted((set(old) | set(new)) - set(RESUMABLE_CHANGES) - set(LOCATION) - set(PLUGIN_PATHS))
    keys = [k for k in keys if not k.startswith(RESUMABLE_SECTIONS)]
    changed = [k for k in keys if old.get(k, defaults.get(k)) != new.get(k)]
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed]


def component_defaults(resolved: dict[str, Any]) -> dict[str, Any]:
    """ "section.key" -> default value (as the resolved config writes it) of the parameters of each named component."""
    out = {}
    for section, registry in component_registries():
        entry = registry.get(resolved[section]["name"]) if section in resolved else None
        if entry is None or entry.params is None:
            continue
        try:
            defaults = entry.params().model_dump(mode="json")
        except ValidationError:  # a parameter without a default: none of them counts as added
            continue
        out.update({f"{section}.{key}": value for key, value in defaults.items()})
    return out


@dataclass
class Training:
    """What a run trains with: the global model, its flat view, the algorithm and the runner of client updates."""

    model: torch.nn.Module
    flat: FlatModel
    setup: Setup
    algo: Algorithm
    runner: ClientRunner
    weights: InitialWeights | None = None  # where the initial global model came from (model.init, model.pretrained)


def build_training(cfg: Config, fed: FederatedDataset) -> Training:
    """The model (seeded from the run seed), the algorithm with its server side initialised, and the client runner
    for a run of ``cfg`` on ``fed``. The simulation and every Flower node build theirs here, so a client's reply
    depends only on (config, message, data, state), never on where it runs."""
    from fedhet.engine.memory import check_model_fits
    from fedhet.models import build_model

    plugins.load(cfg.run.plugins)  # worker processes and Flower nodes start here
    device = torch.device(cfg.run.device)
    algo_cls, algo_cfg = algorithm_config(cfg)
    # too big for the device: a ConfigError, before allocating
    check_model_fits(cfg, fed, device, algo_cls, algo_cfg, adapt_model)

    frozen: dict[str, torch.Tensor] = {}

    weights = initial_weights(cfg.model.name, cfg.model.params(), cfg.model.init)
    said: list[str] = []

    def make_model():
        # Auxiliary models (frozen global/previous models) are built lazily inside clients; forking the RNG
        # keeps their construction from shifting the client's random stream (dropout, augmentation).
        with torch.random.fork_rng(devices=[]):
            model = build_model(cfg.model.name, fed.input_shape, fed.num_classes, **cfg.model.params())
            if weights is not None:  # every model starts from them, as the global one does (a personal model too)
                said[:] = load_into(model, weights, cfg.model.replace_head)
            model = algo_cls.prepare_model(algo_cfg, model)
            model = algo_cls.prepare_federated_model(algo_cfg, model, fed.num_clients)
            model = adapt_model(cfg, model).to(device)
        # frozen parameters never travel: every copy takes the global model's, so a teacher or a second model run
        # through functional_call at the flat parameters is the same function as the global model there
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in frozen:
                    p.copy_(frozen[name])
        return model

    torch.manual_seed(derive_seed(cfg.run.seed, 0x40DE1))
    model = make_model()
    check_token_ids(cfg.model.name, model, fed)
    frozen.update({n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad})
    flat = FlatModel(model)
    setup = Setup(fed.num_clients, fed.num_classes, cfg.train, make_model, device, cfg.privacy)
    algo = build_algorithm(cfg, setup)
    attach_privacy(cfg, algo, flat, fed)
    ranks = client_lora_ranks(cfg, cfg.partition.num_clients)  # by global client id, on a Flower node too
    if cfg.server.lora_aggregation == "flexlora" or ranks is not None:
        from fedhet.toolkit.lora import LoraAggregator, model_pairs

        algo.lora = LoraAggregator(cfg.server.lora_aggregation, model_pairs(flat), ranks)
    algo.init_server(flat.get_params(), flat.get_buffers())
    augment = build_augment(cfg.train.augment, fed.pad_value)
    runner = ClientRunner(
        algo,
        flat,
        cfg.train,
        augment,
        cfg.run.seed,
        cfg.run.eval_local_models,
        cfg.run.eval_batch_size,
        attack=None if cfg.attack.kind == "none" else Attack(cfg.attack, fed, cfg.run.seed),
        lora_ranks=ranks,
        compile_mode=cfg.run.compile,
    )
    if weights is not None:
        weights.notes = said
    return Training(model, flat, setup, algo, runner, weights)


def check_token_ids(name: str, model: torch.nn.Module, fed: FederatedDataset) -> None:
    """Token ids beyond the model's embedding (a pretrained tokenizer's vocabulary for a tiny model) are refused in one
    line before training, not met as an IndexError in every client."""
    embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    tensors = [c.x for c in fed.clients] + [fed.x_test]
    if embedding is None or not all(t.dtype == torch.int64 for t in tensors):
        return
    largest = max((int(t.max()) for t in tensors if t.numel()), default=-1)
    if largest >= embedding.num_embeddings:
        raise ConfigError(
            f"the dataset's token ids go up to {largest}, and model {name!r} embeds {embedding.num_embeddings}: set "
            f"model.vocab_size = {largest + 1} (or more: the tokenizer's vocabulary)"
        )


def adapt_model(cfg: Config, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with ``model.freeze``'s modules frozen and ``model.lora_*``'s adapters added (models/adapt.py);
    FFA-LoRA (``server.lora_aggregation = "ffa"``) keeps the adapters' A matrices frozen."""
    from fedhet.models.adapt import adapt

    lora = cfg.model.lora(train_a=cfg.server.lora_aggregation != "ffa")
    if cfg.model.freeze == "none" and lora is None:
        return model
    return adapt(model, cfg.model.name, cfg.model.freeze, lora)


def training_federation(cfg: Config, fed: FederatedDataset, in_process: bool) -> FederatedDataset:
    """The clients that train: ``fed``, or one client holding all of their data for a method that pools them
    (``centralized``, the upper bound), which exists only in the simulation."""
    if not algorithm_config(cfg)[0].pools_clients:
        return fed
    if not in_process:
        raise ConfigError(
            f"{cfg.algorithm.name} trains one client holding every client's data, which exists only in the "
            "simulation; run it with fedhet run or compare, not over Flower"
        )
    return fed.pooled()


def share_data(algo: Algorithm, fed: FederatedDataset, seed: int) -> None:
    """A data-sharing method (FedMeta) gets its copies of the clients' data, which only the simulation holds."""
    if not algo.shares_data:
        return
    try:
        algo.receive_shared_data(fed, seed)
    except ValueError as err:
        raise ConfigError(f"{err} (its clients' data are on the nodes); run it in the simulation") from None
