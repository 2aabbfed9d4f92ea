"""The single-process simulation: round loop, client sampling, state, evaluation, checkpoints and resume."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedhet.algorithms import (
    ALGORITHMS,
    SERVER_OPTIMIZERS,
    Algorithm,
    Reply,
    Setup,
    build_server_optimizer,
)
from fedhet.algorithms.base import AlgoConfig
from fedhet.config import Config
from fedhet.data.augment import build_augment
from fedhet.data.federated import FederatedDataset, federate
from fedhet.engine.client import ClientRunner, Executor, LocalExecutor, derive_seed
from fedhet.engine.evaluate import evaluate_global
from fedhet.engine.flat import FlatModel
from fedhet.engine.state import build_state_store
from fedhet.errors import ConfigError
from fedhet.results.store import MetricsLog, truncate_after, write_json_atomic


def resolve_config(cfg: Config) -> dict[str, Any]:
    """Validate every component's parameters against its registry entry and return the config with all defaults.

    This runs before any data is loaded, so a wrong name or value fails in a second, not after a download.
    """
    from fedhet.data.datasets import DATASETS
    from fedhet.data.partition import PARTITIONERS
    from fedhet.models import MODELS

    out = cfg.to_dict()
    for section, registry in (
        ("dataset", DATASETS),
        ("partition", PARTITIONERS),
        ("model", MODELS),
        ("algorithm", ALGORITHMS),
        ("server", SERVER_OPTIMIZERS),
    ):
        comp = getattr(cfg, section)
        entry, parsed = registry.parse(comp.name, comp.params())
        params = parsed.model_dump(mode="json") if parsed is not None else {}
        fixed = {k: v for k, v in out[section].items() if k not in comp.params()}
        out[section] = {**fixed, "name": entry.name, **params}
    return out


def build_federation(cfg: Config) -> FederatedDataset:
    from fedhet.data.datasets import load_dataset
    from fedhet.data.partition import partition

    ds = load_dataset(cfg.dataset.name, cfg.dataset.data_dir, **cfg.dataset.params())
    p = cfg.partition
    seed = cfg.run.seed if p.seed is None else p.seed
    labels, groups = ds.y_train, ds.groups_train
    if p.merge_test:
        labels = np.concatenate([ds.y_train, ds.y_test])
        if groups is not None and ds.groups_test is not None:
            groups = np.concatenate([groups, ds.groups_test])
    parts = partition(p.name, labels, p.num_clients, seed, groups=groups, **p.params())
    return federate(
        ds,
        parts,
        local_test_fraction=p.local_test_fraction,
        merged=p.merge_test,
        seed=seed,
        device=cfg.run.device,
    )


def algorithm_config(cfg: Config) -> tuple[type[Algorithm], AlgoConfig]:
    """The algorithm class named in ``cfg`` and its validated hyper-parameters."""
    entry, params = ALGORITHMS.parse(cfg.algorithm.name, cfg.algorithm.params())
    return entry.obj, params


def build_algorithm(cfg: Config, setup: Setup) -> Algorithm:
    algo_cls, algo_cfg = algorithm_config(cfg)
    return algo_cls(algo_cfg, setup, build_server_optimizer(cfg.server.name, cfg.server.params()))


# What a resumed run may change: how far it goes and how it reports, never what the rounds so far computed.
RESUMABLE_CHANGES = ("run.rounds", "run.progress", "run.checkpoint_every")


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The settings (as "section.key: old -> new") that forbid resuming a run saved with ``saved``."""
    from fedhet.results.report import flatten

    old, new = flatten(saved), flatten(current)
    keys = sorted((set(old) | set(new)) - set(RESUMABLE_CHANGES))
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


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
    from fedhet.models import build_model

    device = torch.device(cfg.run.device)
    algo_cls, algo_cfg = algorithm_config(cfg)

    def make_model():
        # Auxiliary models (frozen global/previous models) are built lazily inside clients; forking the RNG
        # keeps their construction from shifting the client's random stream (dropout, augmentation).
        with torch.random.fork_rng(devices=[]):
            model = build_model(cfg.model.name, fed.input_shape, fed.num_classes, **cfg.model.params())
            return algo_cls.prepare_model(algo_cfg, model).to(device)

    torch.manual_seed(derive_seed(cfg.run.seed, 0x40DE1))
    model = make_model()
    flat = FlatModel(model)
    setup = Setup(fed.num_clients, fed.num_classes, cfg.train, make_model, device)
    algo = build_algorithm(cfg, setup)
    algo.init_server(flat.get_params(), flat.get_buffers())
    runner = ClientRunner(algo, flat, cfg.train, build_augment(cfg.train.augment, fed.pad_value), cfg.run.seed)
    return Training(model, flat, setup, algo, runner)


@dataclass
class RoundResult:
    replies: dict[int, Reply]
    failures: list[dict[str, Any]]


class Simulation:
    """One run: ``Simulation(cfg).run()`` trains, evaluates and writes the run folder."""

    def __init__(
        self,
        cfg: Config,
        fed: FederatedDataset | None = None,
        console: Console | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.cfg = cfg
        self.resolved = resolve_config(cfg)
        self.console = console or Console(stderr=True)
        self.name = cfg.run.name or cfg.default_name()
        self.run_dir = Path(cfg.run.out_dir) / self.name
        self.fed = fed if fed is not None else build_federation(cfg)
        self.device = torch.device(cfg.run.device)
        parts = build_training(cfg, self.fed)
        self.model, self.flat, self.setup, self.algo = parts.model, parts.flat, parts.setup, parts.algo
        store = build_state_store(cfg.run.client_state, self.run_dir / "client_state", cfg.run.client_state_budget_mb)
        self.executor: Executor = executor or LocalExecutor(parts.runner, self.fed.clients, store)
        self.seen: set[int] = set()  # clients that have completed at least one round
        self.ema: float | None = None

    # ------------------------------------------------------------------ sampling and clients
    def sample_clients(self, rnd: int) -> list[int]:
        n, k = self.fed.num_clients, self.cfg.clients_per_round()
        if k >= n:
            return list(range(n))
        rng = np.random.default_rng(derive_seed(self.cfg.run.seed, rnd, 0x5A))
        return sorted(int(c) for c in rng.choice(n, size=k, replace=False))

    def run_phase(self, rnd: int, phase_idx: int, phase: str, cids: list[int]) -> RoundResult:
        msgs = self.algo.configure(rnd, cids, phase)
        replies, failures = self.executor.run_phase(rnd, phase_idx, phase, msgs)
        replies = dict(sorted(replies.items()))  # aggregation order is fixed, whatever order clients ran in
        if replies:
            self.algo.aggregate(rnd, replies, phase)
            self.seen.update(replies)
        return RoundResult(replies, failures)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, rnd: int, result: RoundResult, started: float) -> dict[str, Any]:
        self.flat.set_params(self.algo.global_params)
        self.flat.set_buffers(self.algo.global_buffers)
        metrics = evaluate_global(self.model, self.fed, self.cfg.run.eval_batch_size)
        acc = metrics["test_acc"]
        self.ema = acc if self.ema is None else self.cfg.run.ema * self.ema + (1 - self.cfg.run.ema) * acc
        replies = result.replies
        n = sum(r.num_examples for r in replies.values())
        train_loss = sum(r.metrics.get("train_loss", math.nan) * r.num_examples for r in replies.values())
        record = {
            "round": rnd,
            "elapsed_s": round(time.perf_counter() - started, 4),
            "lr": self.algo.round_lr(rnd),
            "train_loss": train_loss / n if n else None,
            "clients": len(replies),
            "dropped": len(result.failures),
            **metrics,
            "test_acc_ema": self.ema,
        }
        record.update(self.personal_metrics(rnd))
        record.update(self.algo.round_metrics(rnd))
        return record

    def personal_metrics(self, rnd: int) -> dict[str, Any]:
        """Each client's personalised model on its local test split (micro and macro averages).

        Only clients that have trained at least once are evaluated; the others are counted, not silently scored
        with the global model."""
        if not self.algo.personalized:
            return {}
        p = self.algo.personal_metric_prefix
        cids = sorted(self.seen)
        accs = self.executor.personal_accuracies(rnd, cids, self.algo.global_message(rnd), self.cfg.run.eval_batch_size)
        if not accs:
            return {f"{p}_clients": 0, f"{p}_never_sampled": self.fed.num_clients - len(cids)}
        correct, total = np.array(list(accs.values())).sum(axis=0)
        return {
            f"{p}_acc_micro": float(correct / max(total, 1)),
            f"{p}_acc_macro": float(np.mean([c / max(n, 1) for c, n in accs.values()])),
            f"{p}_clients": len(accs),
            f"{p}_never_sampled": self.fed.num_clients - len(cids),
        }

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoints" / "last.pt"

    def save_checkpoint(self, rnd: int, wall: float) -> None:
        state = {
            "round": rnd,
            "algo": self.algo.state_dict(),
            "executor": self.executor.state_dict(),
            "seen": sorted(self.seen),
            "ema": self.ema,
            "wall_s": wall,
            "config": self.resolved,
        }
        path = self.checkpoint_path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a crash leaves the previous checkpoint intact

    def load_checkpoint(self) -> tuple[int, float]:
        state = torch.load(self.checkpoint_path, weights_only=False)
        changed = config_changes(state["config"], self.resolved)
        if changed:
            raise ConfigError(
                f"cannot resume {self.run_dir}: its config differs from this one in {', '.join(changed)}; "
                f"use a new run name or --overwrite (only {', '.join(RESUMABLE_CHANGES)} may change)"
            )
        self.algo.load_state_dict(state["algo"])
        self.executor.load_state_dict(state["executor"])
        self.seen = set(state["seen"])
        self.ema = state["ema"]
        return state["round"], state["wall_s"]

    # ------------------------------------------------------------------ the run
    def prepare_dir(self, resume: bool, overwrite: bool) -> int:
        """Set up the run folder; returns the last finished round (0 for a fresh run)."""
        if overwrite and self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        if resume and self.checkpoint_path.exists():
            done, self._wall_before = self.load_checkpoint()
            truncate_after(self.run_dir / "metrics.jsonl", done)
            truncate_after(self.run_dir / "failures.jsonl", done)
            write_json_atomic(self.run_dir / "config.json", self.resolved)  # e.g. run.rounds raised to extend it
            return done
        if resume:  # crashed before its first checkpoint: start over, keeping nothing stale
            truncate_after(self.run_dir / "metrics.jsonl", 0)
            truncate_after(self.run_dir / "failures.jsonl", 0)
        elif (self.run_dir / "metrics.jsonl").exists():
            raise ConfigError(
                f"run folder {str(self.run_dir)!r} already holds a run; pass --resume to continue "
                "it, --overwrite to replace it, or choose another run.name"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.run_dir / "config.json", self.resolved)
        return 0

    def run(self, resume: bool = False, overwrite: bool = False, stop_after: int | None = None) -> dict[str, Any]:
        """Train to ``run.rounds`` (or stop after round ``stop_after``, used to test kill-and-resume)."""
        self._wall_before = 0.0
        done = self.prepare_dir(resume, overwrite)
        metrics_log = MetricsLog(self.run_dir / "metrics.jsonl")
        failures_log = MetricsLog(self.run_dir / "failures.jsonl")
        rounds, started = self.cfg.run.rounds, time.perf_counter()
        last = stop_after if stop_after is not None else rounds
        record: dict[str, Any] = {}
        with self._progress() as progress:
            task = progress.add_task(self.name, total=rounds, completed=done, acc="—")
            for rnd in range(done + 1, last + 1):
                cids = self.sample_clients(rnd)
                for phase_idx, phase in enumerate(self.algo.phases):
                    result = self.run_phase(rnd, phase_idx, phase, cids)
                    for f in result.failures:
                        failures_log.append(f)
                if rnd % self.cfg.run.eval_every == 0 or rnd == rounds:
                    record = self.evaluate(rnd, result, started)
                    metrics_log.append(record)
                    progress.update(task, acc=f"{100 * record['test_acc']:.2f}%")
                if rnd % self.cfg.run.checkpoint_every == 0 or rnd == last:
                    self.save_checkpoint(rnd, self._wall_before + time.perf_counter() - started)
                progress.update(task, advance=1)
        return self.write_summary(last, started)

    def write_summary(self, last: int, started: float) -> dict[str, Any]:
        from fedhet.results.store import read_metrics

        records = read_metrics(self.run_dir / "metrics.jsonl")
        accs = [r["test_acc"] for r in records if "test_acc" in r]
        summary = {
            "name": self.name,
            "status": "finished" if last >= self.cfg.run.rounds else "stopped",
            "rounds_done": last,
            "algorithm": self.cfg.algorithm.name,
            "dataset": self.cfg.dataset.name,
            "partition": self.cfg.partition.name,
            "seed": self.cfg.run.seed,
            "final": records[-1] if records else {},
            "best_test_acc": max(accs) if accs else None,
            "wall_time_s": round(self._wall_before + time.perf_counter() - started, 3),
        }
        write_json_atomic(self.run_dir / "summary.json", summary)
        return summary

    def _progress(self) -> Progress:
        return Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("acc {task.fields[acc]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.cfg.run.progress,
            transient=False,
        )
