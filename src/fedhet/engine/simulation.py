"""The single-process simulation: round loop, client sampling, state, evaluation, checkpoints and resume."""

from __future__ import annotations

import errno
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedhet import plugins
from fedhet.algorithms import (
    ALGORITHMS,
    SERVER_OPTIMIZERS,
    Algorithm,
    Reply,
    Setup,
    build_server_optimizer,
)
from fedhet.algorithms.base import AlgoConfig
from fedhet.algorithms.gne import GNE
from fedhet.config import Config
from fedhet.data.augment import build_augment
from fedhet.data.federated import FederatedDataset, federate
from fedhet.engine.batched import BatchedExecutor, choose_executor
from fedhet.engine.checkpoint import LAST, CheckpointError, load_latest, remove_temporaries, write_checkpoint
from fedhet.engine.client import LOCAL_BUFFERS, LOCAL_PARAMS, ClientRunner, Executor, LocalExecutor
from fedhet.engine.evaluate import client_accuracy, client_test_samples, evaluate, evaluate_global, local_risk
from fedhet.engine.flat import FlatModel
from fedhet.engine.local import derive_seed
from fedhet.engine.rundir import (
    check_run_flags,
    environment,
    environment_changes,
    holds_run,
    make_out_dir,
    remove_run_dir,
    usable_cores,
)
from fedhet.engine.state import build_state_store
from fedhet.errors import ConfigError, CorruptFile, DiskFull, RunFailed
from fedhet.registry import Registry
from fedhet.results.store import (
    MetricsLog,
    read_json,
    read_metrics,
    to_json,
    truncate_after,
    write_json_atomic,
    write_text_atomic,
)
from fedhet.results.trackers import Trackers


def component_registries() -> tuple[tuple[str, Registry], ...]:
    """The config sections that name a registered component, with their registries."""
    from fedhet.data.datasets import DATASETS
    from fedhet.data.partition import PARTITIONERS
    from fedhet.models import MODELS

    return (
        ("dataset", DATASETS),
        ("partition", PARTITIONERS),
        ("model", MODELS),
        ("algorithm", ALGORITHMS),
        ("server", SERVER_OPTIMIZERS),
    )


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
    return out


def check_aggregation(cfg: Config) -> None:
    """``server.aggregation = "gne"`` only for algorithms whose server takes a weighted average of client models."""
    if cfg.server.aggregation != "gne":
        return
    entry = ALGORITHMS.get(cfg.algorithm.name)
    if not entry.obj.accepts_gne():
        able = [e.name for e in ALGORITHMS.entries() if e.obj.accepts_gne()]
        raise ConfigError(
            f"server.aggregation='gne' replaces the weights of a weighted average of client models, which "
            f"{entry.name}'s server does not take; algorithms that accept it: {', '.join(able)}"
        )


def build_federation(cfg: Config) -> FederatedDataset:
    from fedhet.data.datasets import load_dataset
    from fedhet.data.partition import label_counts, match_test, natural_test, partition

    plugins.load(cfg.run.plugins)  # a Flower node builds its data here without resolving the config first
    ds = load_dataset(cfg.dataset.name, cfg.dataset.data_dir, **cfg.dataset.params()).train_subset(
        cfg.dataset.train_fraction
    )
    p = cfg.partition
    seed = cfg.run.seed if p.seed is None else p.seed
    labels, groups = ds.y_train, ds.groups_train
    if p.merge_test:
        labels = np.concatenate([ds.y_train, ds.y_test])
        if groups is not None and ds.groups_test is not None:
            groups = np.concatenate([groups, ds.groups_test])
    parts = partition(p.name, labels, p.num_clients, seed, groups=groups, **p.params())
    test_parts = None
    if p.local_test == "matched":
        if not ds.has_test_set:
            raise ConfigError(f"partition.local_test='matched' needs a test set, and {ds.name!r} has none; use 'split'")
        counts = label_counts(ds.y_train, parts, ds.num_classes)
        test_parts = match_test(ds.y_test, counts, np.random.default_rng([seed, 0x7E5]))
    elif p.local_test == "natural":
        if ds.groups_test is None or not ds.has_test_set:
            raise ConfigError(
                f"partition.local_test='natural' needs a dataset with a per-user test split, and {ds.name!r} has "
                "none (synthetic with dataset.generator='fedbc' has one); use 'split'"
            )
        test_parts = natural_test(groups, parts, ds.groups_test)
    return federate(
        ds,
        parts,
        local_test_fraction=p.local_test_fraction,
        merged=p.merge_test,
        seed=seed,
        device=cfg.run.device,
        test_parts=test_parts,
    )


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
    return algo


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
    "run.client_metrics",  # whether client_metrics.jsonl is written: a copy of what the clients reported
)
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


def build_training(cfg: Config, fed: FederatedDataset) -> Training:
    """The model (seeded from the run seed), the algorithm with its server side initialised, and the client runner
    for a run of ``cfg`` on ``fed``. The simulation and every Flower node build theirs here, so a client's reply
    depends only on (config, message, data, state), never on where it runs."""
    from fedhet.models import build_model, check_model_fits

    plugins.load(cfg.run.plugins)  # worker processes and Flower nodes start here
    device = torch.device(cfg.run.device)
    check_model_fits(cfg, fed, device)  # a model too big for the device: one ConfigError, before it is allocated
    algo_cls, algo_cfg = algorithm_config(cfg)

    def make_model():
        # Auxiliary models (frozen global/previous models) are built lazily inside clients; forking the RNG
        # keeps their construction from shifting the client's random stream (dropout, augmentation).
        with torch.random.fork_rng(devices=[]):
            model = build_model(cfg.model.name, fed.input_shape, fed.num_classes, **cfg.model.params())
            model = algo_cls.prepare_model(algo_cfg, model)
            return algo_cls.prepare_federated_model(algo_cfg, model, fed.num_clients).to(device)

    torch.manual_seed(derive_seed(cfg.run.seed, 0x40DE1))
    model = make_model()
    flat = FlatModel(model)
    setup = Setup(fed.num_clients, fed.num_classes, cfg.train, make_model, device)
    algo = build_algorithm(cfg, setup)
    algo.init_server(flat.get_params(), flat.get_buffers())
    augment = build_augment(cfg.train.augment, fed.pad_value)
    runner = ClientRunner(
        algo, flat, cfg.train, augment, cfg.run.seed, cfg.run.eval_local_models, cfg.run.eval_batch_size
    )
    return Training(model, flat, setup, algo, runner)


@dataclass
class RoundResult:
    replies: dict[int, Reply]
    failures: list[dict[str, Any]]


def nonfinite(tree: Any, prefix: str = "") -> list[str]:
    """The names of the non-finite tensors and floats in a (nested) state dict."""
    if isinstance(tree, dict):
        return [n for k, v in tree.items() for n in nonfinite(v, f"{prefix}{k}.")]
    if isinstance(tree, list | tuple):
        return [n for i, v in enumerate(tree) for n in nonfinite(v, f"{prefix}{i}.")]
    name = prefix.rstrip(".")
    if isinstance(tree, torch.Tensor):
        return [] if not tree.is_floating_point() or bool(torch.isfinite(tree).all()) else [name]
    if isinstance(tree, float):
        return [] if math.isfinite(tree) else [name]
    return []


# errnos of a write that failed for want of space: the run stops with DiskFull and resumes once space is freed
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


# Below this many cores, auto keeps clients in this process: on 2 cores, torch's two intra-op threads trained the
# benchmark's CNN as fast as two worker processes and the demo's MLP faster (docs/performance.md).
AUTO_WORKERS_MIN_CORES = 4


def resolve_workers(cfg: Config) -> int:
    """``run.workers``, with 0 (auto) decided here: one worker per core (at most one per client of a round) on a CPU
    with at least ``AUTO_WORKERS_MIN_CORES`` cores, where intra-op threading no longer scales with the small batches
    of FL clients; else, and on a GPU, clients train in this process."""
    if cfg.run.workers:
        return cfg.run.workers
    cores, per_round = usable_cores(), cfg.clients_per_round()
    if torch.device(cfg.run.device).type != "cpu" or cores < AUTO_WORKERS_MIN_CORES or per_round < 2:
        return 1
    return min(cores, per_round)


class Simulation:
    """One run: ``Simulation(cfg).run()`` trains, evaluates and writes the run folder."""

    # how the user asks to continue or replace a run folder, as messages word it (the Flower app says it its way)
    flags = {"resume": "--resume", "overwrite": "--overwrite"}

    def __init__(
        self,
        cfg: Config,
        fed: FederatedDataset | None = None,
        console: Console | None = None,
        executor: Executor | None = None,
        on_round: Callable[[int, dict[str, Any] | None], None] | None = None,
    ) -> None:
        self.cfg = cfg
        # told (rounds done, that round's metrics or None) once the folder is ready and after every round
        self.on_round = on_round
        self.resolved = resolve_config(cfg)
        self.console = console or Console(stderr=True)
        self.name = cfg.run.name or cfg.default_name()
        self.run_dir = Path(cfg.run.out_dir) / self.name
        self.fed = fed if fed is not None else build_federation(cfg)
        # what evaluation measures on: the partition's clients, also when training pools them (centralized)
        self.eval_fed = self.fed
        if algorithm_config(cfg)[0].pools_clients:
            if executor is not None:
                raise ConfigError(
                    f"{cfg.algorithm.name} trains one client holding every client's data, which exists only in the "
                    "simulation; run it with fedhet run or compare, not over Flower"
                )
            self.fed = self.fed.pooled()
        self.device = torch.device(cfg.run.device)
        parts = build_training(cfg, self.fed)
        self.model, self.flat, self.setup, self.algo = parts.model, parts.flat, parts.setup, parts.algo
        if self.algo.shares_data:  # a data-sharing method (FedMeta) gets its copies of the clients' data
            try:
                self.algo.receive_shared_data(self.fed, cfg.run.seed)
            except ValueError as err:
                raise ConfigError(f"{err} (its clients' data are on the nodes); run it in the simulation") from None
        store = build_state_store(cfg.run.client_state, self.run_dir / "client_state", cfg.run.client_state_budget_mb)
        self.workers = 1 if executor is not None else resolve_workers(cfg)
        self.executor: Executor = executor or self.build_executor(parts.runner, store)
        # the intra-op threads a client trains with: they decide the last bits (provenance.json, checkpoints)
        self.client_threads = 1 if self.workers > 1 else torch.get_num_threads()
        self.seen: set[int] = set()  # clients that have completed at least one round
        self.ema: float | None = None
        # [tracking]: TensorBoard, MLflow, W&B get copies of the config, metrics and summary (results/trackers.py)
        self.trackers = Trackers(cfg.tracking, self.run_dir, Path(cfg.run.out_dir), self.name, self.warn)
        self.empty_streak = 0  # rounds in a row in which no client finished (some phase lost every client)
        self.empty_rounds = 0  # and in all
        self.metrics_lines: list[str] = []  # metrics.jsonl as written, kept in the checkpoint to check it at resume
        self.notes: list[str] = []  # warnings about what this run can measure, repeated in summary.json
        # run.eval_local_models: the local models (params, buffers) of the last phase's replies, for evaluation
        self.local_models: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.local_kls: list[float] = []  # and their KL(P^m || Q) on their own data (Table 9)
        self._dist_samples: list[np.ndarray] | None = None
        # train.sampling = "dynamic": each client's last measured performance and the round it was measured in
        self.performance: list[float] | None = None
        self.performance_round = 0
        self.sampling_log: MetricsLog | None = None
        # each phase's Reply.metrics of the last round, (examples, metrics) per client: aggregated at evaluation
        self.client_reports: dict[str, dict[int, tuple[int, dict[str, Any]]]] = {}
        self._client_metrics_started = False  # client_metrics.jsonl cut back to the resumed round once

    def build_executor(self, runner: ClientRunner, store: Any) -> Executor:
        """Batched clients, worker processes or one client after another, as ``run.executor`` and ``run.workers``
        decide. Batching runs in this process: asked for, it wins over workers; chosen automatically, only where no
        workers would run (on two cores or more, workers are the faster way: docs/performance.md)."""
        kind, why = choose_executor(self.cfg, runner)
        if self.cfg.run.executor == "batched" and kind != "batched":
            self.warn(f"{why}; its clients train one after another")
        if kind == "batched" and (self.cfg.run.executor == "batched" or self.workers == 1):
            self.workers = 1
            return BatchedExecutor(runner, self.fed.clients, store)
        return self.local_executor(runner, store)

    @property
    def executor_kind(self) -> str:
        """ "batched" or "sequential" (in-process, worker processes and Flower clients give the same bits)."""
        return "batched" if isinstance(self.executor, BatchedExecutor) else "sequential"

    def local_executor(self, runner: ClientRunner, store) -> Executor:
        from fedhet.engine.workers import ProcessExecutor, shared_memory_short

        short = None if self.workers == 1 else shared_memory_short(self.fed.clients)
        if short:
            self.warn(f"run.workers={self.workers} needs the data in shared memory, but {short}: clients train here")
            self.workers = 1
        if self.workers == 1:
            return LocalExecutor(runner, self.fed.clients, store)
        return ProcessExecutor(runner, self.fed, store, self.cfg.to_dict(), self.workers)

    # ------------------------------------------------------------------ sampling and clients
    def sample_clients(self, rnd: int) -> list[int]:
        n, k = self.fed.num_clients, self.cfg.clients_per_round()
        if k >= n:
            return list(range(n))
        rng = np.random.default_rng(derive_seed(self.cfg.run.seed, rnd, 0x5A))
        if self.cfg.train.sampling == "dynamic":
            return self.dynamic_sample(rnd, k, rng)
        return sorted(int(c) for c in rng.choice(n, size=k, replace=False))

    def dynamic_sample(self, rnd: int, k: int, rng: np.random.Generator) -> list[int]:
        """FedUFO's dynamic sampling: the ``train.sampling_worst`` share of the ``k`` clients with the lowest
        performance (ties in a random order), the rest uniformly from the others. The generator is the round's, as
        in uniform sampling, so the draw depends only on (seed, round, performance); logged to sampling.jsonl."""
        acc = np.asarray(self.client_performance(rnd))
        n = len(acc)
        n_worst = math.floor(k * self.cfg.train.sampling_worst)
        worst = np.lexsort((rng.random(n), acc))[:n_worst]  # ascending performance; the random key breaks ties
        others = np.setdiff1d(np.arange(n), worst)
        drawn = rng.choice(others, size=k - n_worst, replace=False)
        if self.sampling_log is not None:
            self.sampling_log.append(
                {
                    "round": rnd,
                    "measured_round": self.performance_round,
                    "worst": [int(c) for c in worst],
                    "worst_acc": [float(acc[c]) for c in worst],
                    "random": sorted(int(c) for c in drawn),
                    "acc_mean": float(acc.mean()),
                }
            )
        return sorted(int(c) for c in np.concatenate([worst, drawn]))

    def client_performance(self, rnd: int) -> list[float]:
        """Every client's accuracy of the current global model (train.sampling_measure), re-measured at the start of
        every ``train.sampling_refresh``-th round."""
        t = self.cfg.train
        if self.performance is None or (rnd - 1) % t.sampling_refresh == 0:
            self.flat.set_params(self.algo.global_params)
            self.flat.set_buffers(self.algo.global_buffers)
            on_train = t.sampling_measure == "train"
            acc = client_accuracy(self.model, self.fed, self.cfg.run.eval_batch_size, on_train=on_train)
            self.performance, self.performance_round = [float(a) for a in acc], rnd
        return self.performance

    def run_phase(self, rnd: int, phase_idx: int, phase: str, cids: list[int]) -> RoundResult:
        msgs = self.algo.configure(rnd, cids, phase)
        replies, failures = self.executor.run_phase(rnd, phase_idx, phase, msgs)
        replies = dict(sorted(replies.items()))  # aggregation order is fixed, whatever order clients ran in
        if phase == self.algo.local_model_phase:  # this round's local models only: never a failed round's ones
            self.local_models = {
                cid: (r.tensors.pop(LOCAL_PARAMS), r.tensors.pop(LOCAL_BUFFERS, None))
                for cid, r in replies.items()
                if LOCAL_PARAMS in r.tensors
            }
            self.local_kls = [r.metrics["local_kl"] for r in replies.values() if "local_kl" in r.metrics]
        self.client_reports[phase] = {cid: (r.num_examples, dict(r.metrics)) for cid, r in replies.items()}
        if replies:
            self.algo.aggregate(rnd, replies, phase)
            self.seen.update(replies)
        return RoundResult(replies, failures)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, rnd: int, result: RoundResult, started: float) -> dict[str, Any]:
        self.flat.set_params(self.algo.global_params)
        self.flat.set_buffers(self.algo.global_buffers)
        metrics = evaluate_global(self.model, self.eval_fed, self.cfg.run.eval_batch_size, self.dist_samples())
        metrics.update(self.local_model_metrics())
        metrics.update(self.extra_model_metrics())
        acc = metrics["test_acc"]
        self.ema = acc if self.ema is None else self.cfg.run.ema * self.ema + (1 - self.cfg.run.ema) * acc
        replies = result.replies
        n = sum(r.num_examples for r in replies.values())
        train_loss = sum(r.metrics.get("train_loss", math.nan) * r.num_examples for r in replies.values())
        record = {
            "round": rnd,
            "elapsed_s": round(self._wall_before + time.perf_counter() - started, 4),  # a resumed run continues
            "lr": self.algo.round_lr(rnd),
            "train_loss": train_loss / n if n else None,
            "clients": len(replies),
            "dropped": len(result.failures),
            **metrics,
            "test_acc_ema": self.ema,
        }
        record.update(self.personal_metrics(rnd))
        record.update(self.algo.round_metrics(rnd))
        record.update(self.algo.aggregation_metrics())
        record.update(self.client_metric_stats())  # after every key above: records only gain keys
        self.write_client_metrics(rnd)
        return record

    def client_metric_stats(self) -> dict[str, float]:
        """What the clients put in ``Reply.metrics`` this round, per metric over the clients that reported it:
        ``clients/<metric>/mean``, ``/min``, ``/max`` and ``/weighted_mean`` (weighted by ``num_examples``); a
        phase other than "train" adds its name (``clients/posterior/disc_loss/mean``). A flag counts as 0 or 1 (as
        Flower's MetricRecord carries it), text is left out. A NaN from any client makes all four NaN (stored as
        null), so a diverged client is never averaged away."""
        out: dict[str, float] = {}
        for phase, reports in self.client_reports.items():
            values: dict[str, list[tuple[float, int]]] = {}
            for examples, metrics in reports.values():
                for name, value in metrics.items():
                    if not isinstance(value, int | float | np.number | np.bool_ | torch.Tensor):
                        continue
                    values.setdefault(name, []).append((float(value), examples))
            prefix = "clients/" if phase == "train" else f"clients/{phase}/"
            for name in sorted(values):
                xs = [v for v, _ in values[name]]
                total = sum(n for _, n in values[name])
                if any(math.isnan(v) for v in xs):
                    stats = dict.fromkeys(("mean", "min", "max", "weighted_mean"), math.nan)
                else:
                    weighted = sum(v * n for v, n in values[name]) / total if total else math.nan
                    stats = {"mean": sum(xs) / len(xs), "min": min(xs), "max": max(xs), "weighted_mean": weighted}
                out.update({f"{prefix}{name}/{stat}": value for stat, value in stats.items()})
        return out

    def write_client_metrics(self, rnd: int) -> None:
        """run.client_metrics: each client's ``Reply.metrics`` of round ``rnd``, one line per (phase, client) in
        ``client_metrics.jsonl`` (``round``, ``phase``, ``client``, ``num_examples``, then the metrics). The first
        evaluation of a process drops the lines a killed run wrote after its last checkpoint, whether or not the
        setting is still on."""
        path = self.run_dir / "client_metrics.jsonl"
        if not self._client_metrics_started:
            self._client_metrics_started = True
            truncate_after(path, rnd - 1)  # the rounds before this one are the resumed checkpoint's
        if not self.cfg.run.client_metrics:
            return
        lines = []
        for phase, reports in self.client_reports.items():
            for cid, (examples, metrics) in reports.items():
                line = {"round": rnd, "phase": phase, "client": cid, "num_examples": examples}
                lines.append({**line, **{k: v for k, v in metrics.items() if k not in line}})
        MetricsLog(path).extend(lines)

    def dist_samples(self) -> list[np.ndarray] | None:
        """The clients' sampled test sets (run.client_dist_sampled): drawn once from the run seed, so every round
        is measured on the same samples."""
        run = self.cfg.run
        if not run.client_dist_sampled:
            return None
        if self._dist_samples is None:
            fixed = run.client_dist_sample_size
            sizes = self.eval_fed.sizes if fixed is None else np.full(self.eval_fed.num_clients, fixed)
            rng = np.random.default_rng(derive_seed(run.seed, 0x7E57))
            y = self.eval_fed.y_test.cpu().numpy()
            self._dist_samples = client_test_samples(y, self.eval_fed.label_distribution(), sizes, rng)
        return self._dist_samples

    def local_model_metrics(self) -> dict[str, float]:
        """FedACD's Tables 3 and 9 for this round's local models (run.eval_local_models): the mean over participants
        of their risk on every client's label distribution, and of their KL(P^m || Q) on their own data."""
        if not self.local_models:
            return {}
        risks = []
        fed, label_dist = self.eval_fed, self.eval_fed.label_distribution()
        for params, buffers in self.local_models.values():
            self.flat.set_params(params)
            if buffers is not None:
                self.flat.set_buffers(buffers)
            stats = evaluate(self.model, fed.x_test, fed.y_test, fed.num_classes, self.cfg.run.eval_batch_size)
            risks.append(local_risk(stats.per_class_acc(), label_dist))
        self.flat.set_params(self.algo.global_params)
        self.flat.set_buffers(self.algo.global_buffers)
        kls, self.local_models, self.local_kls = self.local_kls, {}, []
        out = {"local_risk": float(np.mean(risks))}
        if kls:
            out["local_kl"] = float(np.mean(kls))
        return out

    def extra_model_metrics(self) -> dict[str, float]:
        """Accuracy and loss on the global test set of the other models the algorithm asks to have scored."""
        out = {}
        fed = self.eval_fed
        for name, params in self.algo.extra_eval_params().items():
            self.flat.set_params(params)
            stats = evaluate(self.model, fed.x_test, fed.y_test, fed.num_classes, self.cfg.run.eval_batch_size)
            out[f"{name}_acc"], out[f"{name}_loss"] = stats.acc, stats.loss
        if out:
            self.flat.set_params(self.algo.global_params)
        return out

    def personal_metrics(self, rnd: int) -> dict[str, Any]:
        """Each client's personalised model on its local test split (micro and macro averages).

        Only clients that have trained at least once are evaluated; the others are counted, not silently scored
        with the global model."""
        if not self.algo.personalized:
            return {}
        p = self.algo.personal_metric_prefix
        seen = sorted(self.seen)
        cids = self.personal_sample(rnd, seen)
        accs = self.executor.personal_accuracies(rnd, cids, self.algo.global_message(rnd), self.cfg.run.eval_batch_size)
        counts = {f"{p}_never_sampled": self.fed.num_clients - len(seen)}
        if len(cids) < len(seen):
            counts[f"{p}_sample"] = len(cids)  # a seeded sample of the clients that have trained
        if not accs:
            return {f"{p}_clients": 0, **counts}
        correct, total = np.array(list(accs.values())).sum(axis=0)
        return {
            f"{p}_acc_micro": float(correct / max(total, 1)),
            f"{p}_acc_macro": float(np.mean([c / max(n, 1) for c, n in accs.values()])),
            f"{p}_clients": len(accs),
            **counts,
        }

    def personal_sample(self, rnd: int, seen: list[int]) -> list[int]:
        """At most ``run.personal_eval_clients`` of ``seen``: each personalised model costs a pass over its client's
        test split, so 10,000 of them are measured on a sample drawn from (seed, round)."""
        limit = self.cfg.run.personal_eval_clients
        if limit is None or len(seen) <= limit:
            return seen
        rng = np.random.default_rng(derive_seed(self.cfg.run.seed, rnd, 0xE7A1))
        return sorted(int(c) for c in rng.choice(seen, size=limit, replace=False))

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def checkpoint_path(self) -> Path:
        return self.checkpoint_dir / LAST

    def save_checkpoint(self, rnd: int, wall: float) -> None:
        state = {
            "round": rnd,
            "algo": self.algo.state_dict(),
            "executor": self.executor.state_dict(),
            "seen": sorted(self.seen),
            "ema": self.ema,
            "empty_streak": self.empty_streak,
            "empty_rounds": self.empty_rounds,
            "metrics_log": "".join(self.metrics_lines),
            "performance": self.performance,
            "performance_round": self.performance_round,
            "wall_s": wall,
            "torch_threads": self.client_threads,
            "executor_kind": self.executor_kind,
            "config": self.resolved,
        }
        bad = nonfinite(state["algo"])
        if bad:
            raise RunFailed(f"round {rnd}: the server state became non-finite ({', '.join(bad[:5])})")
        write_checkpoint(self.checkpoint_dir, state, rotate=self._rotate)
        # Free saved client state only now that the checkpoints naming it are replaced: last.pt and prev.pt
        # always find theirs, whenever the process is killed.
        self.executor.retain([s for s in (self._saved_clients, state["executor"]) if s is not None])
        self._saved_clients, self._rotate, self._saved_round = state["executor"], True, rnd

    def resume_state(self) -> int | None:
        """Load the newest usable checkpoint; returns its round, or None when the folder has none."""
        for folder in (self.run_dir, self.checkpoint_dir):
            remove_temporaries(folder)

        def use(state: dict[str, Any]) -> None:
            self.executor.load_state_dict(state["executor"])  # refuses, changing nothing, if its state is gone

        loaded, problems = load_latest(self.checkpoint_dir, use, check=self.check_resumable)  # check: changes nothing
        if loaded is None:
            if problems:
                raise CheckpointError(
                    f"cannot resume {self.run_dir}: no usable checkpoint ({'; '.join(problems)}); "
                    f"start again with {self.flags['overwrite']} (this deletes the run folder)"
                )
            return None
        state = loaded.state
        if problems:
            self.warn(f"{'; '.join(problems)}: resuming from the previous checkpoint, round {state['round']}")
        self.algo.load_state_dict(state["algo"])
        self.seen = set(state["seen"])
        self.ema = state["ema"]
        self.empty_streak = state.get("empty_streak", 0)
        self.empty_rounds = state.get("empty_rounds", self.empty_streak)  # older checkpoints kept only the streak
        self._saved_metrics = state.get("metrics_log")  # None in checkpoints from before fedhet kept it
        self.performance = state.get("performance")
        self.performance_round = state.get("performance_round", 0)
        self._wall_before = state["wall_s"]
        self._saved_clients, self._rotate = state["executor"], loaded.path.name == LAST
        self._saved_round = state["round"]
        self._rounding_changes = self.rounding_changes(state)
        return state["round"]

    def check_resumable(self, state: dict[str, Any]) -> None:
        changed = config_changes(state["config"], self.resolved)
        if changed:
            raise ConfigError(
                f"cannot resume {self.run_dir}: its config differs from this one in {', '.join(changed)}; "
                f"use a new run name or {self.flags['overwrite']} (only {', '.join(RESUMABLE_CHANGES)} may change)"
            )
        if state["round"] > self.cfg.run.rounds:
            raise ConfigError(
                f"cannot resume {self.run_dir} with run.rounds={self.cfg.run.rounds}: it has already trained "
                f"{state['round']} rounds; a run can be extended, not shortened (give -r {state['round']} or more, "
                "or train fewer rounds under a new run name)"
            )

    def rounding_changes(self, state: dict[str, Any]) -> list[str]:
        """How the clients train now unlike before the checkpoint, in ways that change only float rounding."""
        changes = []
        threads = state.get("torch_threads")
        if threads is not None and threads != self.client_threads:
            changes.append(
                f"its clients trained with {threads} torch thread(s) and now train with {self.client_threads} (match "
                f"it with --threads {threads} on fedhet run, resume and compare, or OMP_NUM_THREADS={threads}; "
                "run.workers >= 2 trains with one)"
            )
        kind = state.get("executor_kind")
        if kind is not None and kind != self.executor_kind:
            changes.append(f"its clients trained {kind} and now train {self.executor_kind}")
        return changes

    # ------------------------------------------------------------------ the run folder
    def prepare_dir(self, resume: bool, overwrite: bool) -> int:
        """Set up the run folder; returns the last finished round (0 for a fresh run)."""
        check_run_flags(resume, overwrite)
        make_out_dir(Path(self.cfg.run.out_dir))
        self._wall_before, self._saved_clients, self._rotate, self._saved_round = 0.0, None, True, 0
        self._rounding_changes: list[str] = []  # filled by resume_state, reported with the environment's changes
        if overwrite and self.run_dir.exists():
            remove_run_dir(self.run_dir)
        if resume and self.run_dir.is_dir():
            done = self.resume_state()
            if done is not None:
                self.restore_metrics(done)
                truncate_after(self.run_dir / "failures.jsonl", done)
                truncate_after(self.run_dir / "sampling.jsonl", done)
                write_json_atomic(self.run_dir / "config.json", self.resolved)  # e.g. run.rounds raised to extend it
                self.record_environment(resumed_at=done)
                return done
            self.check_nothing_lost()
            truncate_after(self.run_dir / "metrics.jsonl", 0)  # crashed before its first checkpoint: start over
            truncate_after(self.run_dir / "failures.jsonl", 0)
            truncate_after(self.run_dir / "sampling.jsonl", 0)
        elif holds_run(self.run_dir):
            raise ConfigError(
                f"run folder {str(self.run_dir)!r} already holds a run; pass {self.flags['resume']} to continue "
                f"it, {self.flags['overwrite']} to replace it, or choose another run.name"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.executor.reset()  # a fresh run sees the client states of round 0: none, whatever a crash left
        write_json_atomic(self.run_dir / "config.json", self.resolved)
        self.record_environment(resumed_at=None)
        return 0

    def restore_metrics(self, done: int) -> None:
        """metrics.jsonl up to round ``done``, checked against the records the checkpoint holds: a file deleted,
        emptied, cut short or edited is rebuilt from them, with a warning, so the finished file covers every round."""
        path = self.run_dir / "metrics.jsonl"
        try:
            kept = [r for r in read_metrics(path) if r.get("round", 0) <= done]
        except CorruptFile:
            kept = None
        saved = self._saved_metrics
        if saved is None:  # a checkpoint from before fedhet kept the records: trust the file, as then
            truncate_after(path, done)
            self.metrics_lines = [to_json(r) + "\n" for r in read_metrics(path)]
            return
        self.metrics_lines = saved.splitlines(keepends=True)
        want = [json.loads(line) for line in self.metrics_lines]
        if kept == want:
            truncate_after(path, done)
            return
        if not path.exists():
            why = "is missing"
        elif kept is None:
            why = "is corrupt"
        elif len(kept) != len(want):
            why = f"holds {len(kept)} record(s) up to round {done} where the checkpoint has {len(want)}"
        else:
            why = "differs from the records in the checkpoint"
        self.warn(f"{path} {why}: rebuilt from the checkpoint's {len(want)} record(s) up to round {done}")
        write_text_atomic(path, saved)

    def check_nothing_lost(self) -> None:
        """Refuse to start over a run whose checkpoints are gone although it trained past the first one."""
        records = read_metrics(self.run_dir / "metrics.jsonl")
        saved = self.run_dir / "config.json"
        every = read_json(saved)["run"]["checkpoint_every"] if saved.exists() else self.cfg.run.checkpoint_every
        last = max((r["round"] for r in records), default=0)
        if last > every:
            raise CheckpointError(
                f"cannot resume {self.run_dir}: metrics.jsonl goes to round {last} but checkpoints/ holds no "
                f"checkpoint (deleted?), so nothing can continue it; start again with {self.flags['overwrite']} "
                "(this deletes the run folder) or use a new run name"
            )

    def record_environment(self, resumed_at: int | None) -> None:
        """provenance.json: what ran (data source and hash, versions, thread count), and every resume.

        A resume warns once, naming every change since the checkpoint that alters float rounding."""
        path = self.run_dir / "provenance.json"
        now = {**environment(), "torch_threads": self.client_threads, "workers": self.workers}
        moved: list[str] = []
        info = self.read_provenance(path) if resumed_at is not None else None
        if info is None:
            info = {**now, "data": self.fed.provenance, "resumes": []}
            if resumed_at is not None:
                info["rewritten_at_round"] = resumed_at  # what ran before this resume is not known
        else:
            last = (info["resumes"] or [info])[-1]  # where the run trained until now
            moved = [f"it continues on {change}" for change in environment_changes(last, now)]
            info["resumes"].append({"round": resumed_at, **now})
        changes = self._rounding_changes + moved
        if changes:
            self.warn(
                f"this run resumes, but {'; '.join(changes)}: floats round differently now, so it will not match an "
                "uninterrupted run bit for bit"
            )
        write_json_atomic(path, info)

    def read_provenance(self, path: Path) -> dict[str, Any] | None:
        """provenance.json as the run wrote it, or None (with a warning: it is rewritten) when it is damaged."""
        if not path.exists():
            self.warn(f"{path} is missing; rewritten with this machine's environment")
            return None
        try:
            info = read_json(path, dict)
            if isinstance(info.get("resumes", []), list) and all(isinstance(r, dict) for r in info.get("resumes", [])):
                return {**info, "resumes": info.get("resumes", [])}
            why = f"{path}: 'resumes' is not a list of records"
        except CorruptFile as err:
            why = str(err)
        self.warn(f"{why}; rewritten with this machine's environment (what it recorded of earlier sessions is lost)")
        return None

    def warn(self, text: str) -> None:
        self.console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=True)

    # ------------------------------------------------------------------ the run
    def run(self, resume: bool = False, overwrite: bool = False, stop_after: int | None = None) -> dict[str, Any]:
        """Train to ``run.rounds`` (or stop after round ``stop_after``, used to test kill-and-resume).

        Raises ``RunFailed`` (after writing summary.json with the reason) when the run cannot go on: the global
        model or server state turned non-finite, ``run.max_empty_rounds`` rounds in a row had no client left, or
        every round so far was empty; ``DiskFull`` (a ``RunFailed``) when a file of the run cannot be written."""
        try:
            return self._run(resume, overwrite, stop_after)
        except OSError as err:
            if err.errno not in DISK_FULL:
                raise
            raise self.disk_full(err, None) from None
        finally:
            self.executor.close()

    def disk_full(self, err: OSError, at: int | str | None) -> DiskFull:
        """The one-line error for a file that could not be written: where, the last round safely checkpointed, and
        that ``fedhet resume`` continues once there is space."""
        where = f" writing {err.filename}" if err.filename else f" under {self.run_dir}"
        at = f" in round {at}" if isinstance(at, int) else f" {at or 'while preparing the run folder'}"
        kept = self._saved_round
        safe = f"round {kept} is safely checkpointed" if kept else "no round was checkpointed yet"
        return DiskFull(
            f"{err.strerror or 'cannot write'}{where}{at}: the run stopped; {safe}; free space and run "
            f"fedhet resume {self.run_dir} to continue"
        )

    def _run(self, resume: bool, overwrite: bool, stop_after: int | None) -> dict[str, Any]:
        done = self.prepare_dir(resume, overwrite)
        self.warn_unmeasurable()
        self.trackers.start(self.resolved, resumed_at=done)
        try:
            return self._train(done, stop_after)
        finally:
            self.trackers.close()  # only trackers still open: the run stopped without a summary

    def _train(self, done: int, stop_after: int | None) -> dict[str, Any]:
        metrics_log = MetricsLog(self.run_dir / "metrics.jsonl")
        failures_log = MetricsLog(self.run_dir / "failures.jsonl")
        if self.cfg.train.sampling == "dynamic":
            self.sampling_log = MetricsLog(self.run_dir / "sampling.jsonl")
        rounds, started = self.cfg.run.rounds, time.perf_counter()
        last = stop_after if stop_after is not None else rounds
        self.notes = self.training_notes()
        for note in self.notes:
            self.warn(note)
        with self._progress() as progress:
            task = progress.add_task(self.name, total=rounds, completed=done, acc="—")
            if self.on_round is not None:
                self.on_round(done, None)
            for rnd in range(done + 1, last + 1):
                record = None
                try:
                    result = self.train_round(rnd, failures_log)
                    if rnd % self.cfg.run.eval_every == 0 or rnd == rounds:
                        record = self.evaluate(rnd, result, started)
                        self.metrics_lines.append(metrics_log.append(record))
                        self.trackers.log(record)
                        progress.update(task, acc=f"{100 * record['test_acc']:.2f}%")
                        self.log_line(record)
                    if rnd % self.cfg.run.checkpoint_every == 0 or rnd == last:
                        self.save_checkpoint(rnd, self._wall_before + time.perf_counter() - started)
                except RunFailed as err:
                    self.fail(rnd, started, err)
                except OSError as err:
                    if err.errno not in DISK_FULL:
                        raise
                    self.fail(rnd, started, self.disk_full(err, rnd))
                progress.update(task, advance=1)
                if self.on_round is not None:
                    self.on_round(rnd, record)
        try:
            summary = self.write_summary(last, started)
        except OSError as err:
            if err.errno not in DISK_FULL:
                raise
            raise self.disk_full(err, "after the last round") from None
        for note in summary.get("warnings", [])[len(self.notes) :]:  # those the rounds added
            self.warn(note)
        return summary

    def fail(self, rnd: int, started: float, err: RunFailed) -> None:
        """Write summary.json with status failed (if the disk still takes it) and raise the one-line error."""
        if isinstance(err, DiskFull):
            message = str(err)
        else:
            kept = self._saved_round
            note = f"the last checkpoint (round {kept}) is kept" if kept else "no checkpoint was written"
            message = f"{err}; stopped, {note}"
        try:
            self.write_summary(rnd - 1, started, status="failed", error=message)
        except OSError as again:
            if again.errno not in DISK_FULL:
                raise
            message += " (summary.json could not be written either)"
        raise type(err)(message) from None

    def train_round(self, rnd: int, failures_log: MetricsLog) -> RoundResult:
        """Every phase of round ``rnd``; raises ``RunFailed`` when the run cannot go on."""
        cids = self.sample_clients(rnd)
        empty: list[str] = []  # the phases that lost every client
        for phase_idx, phase in enumerate(self.algo.phases):
            result = self.run_phase(rnd, phase_idx, phase, cids)
            for f in result.failures:
                failures_log.append(f)
            if result.failures:
                self.warn_dropped(rnd, phase, result)
            if not result.replies:
                empty.append(phase)
            bad = nonfinite({"global_params": self.algo.global_params, "global_buffers": self.algo.global_buffers})
            if bad:
                raise RunFailed(f"round {rnd} ({phase}): the global model became non-finite ({', '.join(bad)})")
        self.empty_streak = self.empty_streak + 1 if empty else 0
        self.empty_rounds += bool(empty)
        self.check_trained(rnd, empty)
        return result

    def check_trained(self, rnd: int, empty: list[str]) -> None:
        """Fail when ``run.max_empty_rounds`` rounds in a row were empty, or when the run's last round leaves it
        with no round that any client finished (a run shorter than the limit must not end "finished" untrained)."""
        if not empty:
            return
        limit = self.cfg.run.max_empty_rounds
        lost = "" if empty == ["train"] else f" (phase {', '.join(empty)} lost every client)"
        errors = f"the errors are in {self.run_dir / 'failures.jsonl'}"
        if self.empty_streak >= limit:
            raise RunFailed(
                f"no client finished round {rnd}{f' or the {limit - 1} before it' if limit > 1 else ''}{lost} "
                f"(run.max_empty_rounds={limit}); {errors}"
            )
        if rnd == self.cfg.run.rounds and self.empty_rounds == rnd:
            raise RunFailed(f"no client finished any of the run's {rnd} round(s){lost}, so nothing trained; {errors}")

    def training_notes(self) -> list[str]:
        """What the run will not train on or cannot measure, known before it starts: said at the start and kept
        in summary.json, so a run that trains on (almost) nothing never ends as if it had trained."""
        notes = []
        sizes = [len(c.y) for c in self.fed.clients]
        if not any(sizes):
            return notes  # the data are on the nodes (Flower)
        idle = sum(n == 0 for n in sizes)
        if idle:
            notes.append(f"{idle} of {len(sizes)} clients hold no training samples and drop out whenever sampled")
        total, batch = sum(sizes), self.cfg.train.batch_size
        if total < len(sizes) * batch:
            fraction = self.cfg.dataset.train_fraction
            kept = f" (dataset.train_fraction={fraction:g})" if fraction < 1 else ""
            notes.append(
                f"the clients hold {total} training samples in all{kept}, less than one batch of "
                f"{batch} per client: the run trains on almost nothing"
            )
        return notes

    def round_notes(self, rounds_done: int) -> list[str]:
        """What the rounds so far left untrained: empty rounds, personalised models never trained."""
        notes = []
        if self.empty_rounds:
            notes.append(
                f"{self.empty_rounds} of {rounds_done} round(s) had no client finish (a phase lost every client); "
                "the model did not change in those rounds"
            )
        if self.algo.personalized and rounds_done:
            never = self.fed.num_clients - len(self.seen)
            if never == self.fed.num_clients:
                notes.append("no client ever trained, so no personalised model exists")
            elif never:
                notes.append(
                    f"{never} of {self.fed.num_clients} clients never trained: they have no personalised model "
                    "and are not in the personalised accuracy"
                )
        return notes

    def warn_dropped(self, rnd: int, phase: str, result: RoundResult) -> None:
        n = len(result.failures) + len(result.replies)
        first = result.failures[0]
        why = first["error"] if len(first["error"]) <= 160 else first["error"][:157] + "..."
        self.warn(
            f"round {rnd}{'' if phase == 'train' else f' ({phase})'}: dropped {len(result.failures)} of {n} "
            f"clients (client {first['client']}: {why}); see failures.jsonl"
        )

    def warn_unmeasurable(self) -> None:
        clients = self.fed.clients
        if not self.algo.personalized or all(len(c.y) == 0 for c in clients):  # no data here: held by nodes
            return
        if not any(c.y_test is not None and len(c.y_test) > 0 for c in clients):
            self.warn(
                f"{self.cfg.algorithm.name} is personalised, but the clients have no local test splits, so "
                "personalised accuracy cannot be measured; set partition.local_test_fraction (e.g. 0.2)"
            )

    def write_summary(
        self, last: int, started: float, status: str | None = None, error: str | None = None
    ) -> dict[str, Any]:
        records = read_metrics(self.run_dir / "metrics.jsonl")
        accs = [r["test_acc"] for r in records if r.get("test_acc") is not None]
        summary = {
            "name": self.name,
            "status": status or ("finished" if last >= self.cfg.run.rounds else "stopped"),
            "rounds_done": last,
            "algorithm": self.cfg.algorithm.name,
            "dataset": self.cfg.dataset.name,
            "partition": self.cfg.partition.name,
            "seed": self.cfg.run.seed,
            "final": records[-1] if records else {},
            "best_test_acc": max(accs) if accs else None,
            "empty_rounds": self.empty_rounds,
            "wall_time_s": round(self._wall_before + time.perf_counter() - started, 3),
        }
        warnings = self.notes + self.round_notes(last + 1 if status == "failed" else last)  # a failed round counts
        if warnings:
            summary["warnings"] = warnings
        if error:
            summary["error"] = error
        write_json_atomic(self.run_dir / "summary.json", summary)
        self.trackers.finish(summary)
        return summary

    @property
    def interactive(self) -> bool:
        """The console redraws a progress bar: a terminal or a notebook."""
        return self.console.is_terminal or self.console.is_jupyter

    def log_line(self, record: dict[str, Any]) -> None:
        """Where the console is not a terminal (a log file, a pipe), the bar cannot redraw: one line per evaluation
        instead, so a long run is never silent until it ends."""
        if not self.cfg.run.progress or self.interactive:
            return
        loss = record.get("train_loss")
        text = f"{self.name}: round {record['round']}/{self.cfg.run.rounds}, test_acc {100 * record['test_acc']:.2f}%"
        text += f", train_loss {loss:.4g}" if loss is not None else ""
        text += f", {record['clients']} clients, {record['elapsed_s']:.1f} s"
        self.console.print(escape(text), highlight=False, soft_wrap=True)

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("acc {task.fields[acc]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not (self.cfg.run.progress and self.interactive),  # else log_line's lines
            transient=False,
        )
