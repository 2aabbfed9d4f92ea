"""The single-process simulation: the round loop.

``Simulation.run`` reads as the loop: sample, run each phase (configure, clients, aggregate), evaluate when due,
checkpoint when due, log. The parts it composes each have one job: ``training`` (what the run trains with, from its
config), ``executors`` (who trains the clients), ``sampling`` (which clients), ``evaluation`` (what a round
measures), ``health`` (whether the run trained), ``runfolder`` (the run folder's files, resume and summary) and
``display`` (the progress bar and warnings). The checkpoint's content is assembled here, from every part's state."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from fedhet.config import Config
from fedhet.data.federated import FederatedDataset
from fedhet.engine.attack import attack_record
from fedhet.engine.checkpoint import LAST, write_checkpoint
from fedhet.engine.client import Executor, RoundResult
from fedhet.engine.display import RunDisplay
from fedhet.engine.evaluation import Evaluator
from fedhet.engine.executors import build_executor, executor_kind
from fedhet.engine.health import RunHealth, nonfinite, training_errors
from fedhet.engine.initial import INIT_KEY, LAYOUT_KEY, model_layout
from fedhet.engine.initial import check_resume as check_init
from fedhet.engine.rundir import environment, usable_cores
from fedhet.engine.runfolder import DISK_FULL, Checks, RunFolder, rounding_changes
from fedhet.engine.sampling import ClientSampler
from fedhet.engine.state import build_state_store
from fedhet.engine.system import RoundPlan, SystemModel, build_system
from fedhet.engine.training import (  # noqa: F401  (the names below were this module's before the split)
    RESUMABLE_CHANGES,
    algorithm_config,
    build_algorithm,
    build_federation,
    build_training,
    config_changes,
    resolve_config,
    share_data,
    training_federation,
)
from fedhet.errors import ConfigError, DiskFull, RunFailed
from fedhet.naming import run_name
from fedhet.results.store import write_json_atomic
from fedhet.results.trackers import Trackers

# the checkpoint's record of the data its rounds trained on (FederatedDataset.fingerprint)
DATA_KEY = "data_sha256"

# how the user asks to continue or replace a run folder, as messages word it (the Flower app words it its way)
FLAGS = {"resume": "--resume", "overwrite": "--overwrite"}


class Simulation:
    """One run: ``Simulation(cfg).run()`` trains, evaluates and writes the run folder."""

    def __init__(
        self,
        cfg: Config,
        fed: FederatedDataset | None = None,
        console: Console | None = None,
        executor: Executor | None = None,
        on_round: Callable[[int, dict[str, Any] | None], None] | None = None,
    ) -> None:
        self.cfg, self.on_round = cfg, on_round  # on_round: told (rounds done, that round's record or None)
        self.resolved = resolve_config(cfg)
        self.name = run_name(cfg)
        self.run_dir = Path(cfg.run.out_dir) / self.name
        self.display = RunDisplay(console or Console(stderr=True), self.name, cfg.run.rounds, cfg.run.progress)
        self.eval_fed = fed if fed is not None else build_federation(cfg)  # the partition's clients, evaluated
        self.fed = training_federation(cfg, self.eval_fed, in_process=executor is None)  # pooled for centralized
        parts = build_training(cfg, self.fed)
        self.model, self.flat, self.setup, self.algo = parts.model, parts.flat, parts.setup, parts.algo
        self.weights = parts.weights  # model.init or model.pretrained: the initial global model's source
        share_data(self.algo, self.fed, cfg.run.seed)
        store = build_state_store(cfg.run.client_state, self.run_dir / "client_state", cfg.run.client_state_budget_mb)
        self.workers = 1 if executor is not None else resolve_workers(cfg)
        if executor is None:
            executor, self.workers = build_executor(cfg, parts.runner, self.fed, store, self.workers, self.warn)
        self.executor: Executor = executor
        # the intra-op threads a client trains with: they decide the last bits (provenance.json, checkpoints)
        self.client_threads = 1 if self.workers > 1 else torch.get_num_threads()
        self.seen: set[int] = set()  # clients that have completed at least one round
        self.sampler = ClientSampler(cfg, self.fed, self.model, self.flat, self.algo)
        # [system]: who is online, how much each client trains, the simulated clock (engine/system.py)
        self.system: SystemModel | None = build_system(cfg, self.fed, self.flat, len(self.algo.phases))
        self.plan: RoundPlan | None = None  # the system model's plan of the last round trained
        self.folder = RunFolder(self.run_dir, cfg, self.resolved, self.warn, dict(FLAGS))
        self.evaluator = Evaluator(
            cfg,
            self.eval_fed,
            self.model,
            self.flat,
            self.algo,
            self.executor,
            self.run_dir,
            self.seen,
            self.folder.warn_once,
        )
        self.health = RunHealth(cfg, self.fed, self.algo)
        self.attack = attack_record(cfg, self.fed.num_clients)  # which clients are malicious, under [attack]
        # [tracking]: TensorBoard, MLflow, W&B get copies of the config, metrics and summary (results/trackers.py)
        self.trackers = Trackers(cfg.tracking, self.run_dir, Path(cfg.run.out_dir), self.name, self.warn)
        self._wall_before, self._saved_clients, self._rotate, self._saved_round = 0.0, None, True, 0
        self.stop_status: str | None = None  # set by request_stop (a tuner's pruned trial)

    # ------------------------------------------------------------------ the run
    def run(self, resume: bool = False, overwrite: bool = False, stop_after: int | None = None) -> dict[str, Any]:
        """Train to ``run.rounds`` (or stop after round ``stop_after``, used to test kill-and-resume).

        Raises ``RunFailed`` (after writing summary.json with the reason) when the run cannot go on: the global
        model or server state turned non-finite, ``run.max_empty_rounds`` rounds in a row had no client left, or
        every round so far was empty; ``DiskFull`` (a ``RunFailed``) when a file of the run cannot be written."""
        try:
            done = self.prepare_dir(resume, overwrite)
            self.trackers.start(self.resolved, resumed_at=done)
            try:
                return self.train(done, stop_after)
            finally:
                self.trackers.close()  # only trackers still open: the run stopped without a summary
        except OSError as err:
            if err.errno not in DISK_FULL:
                raise
            raise self.folder.disk_full(err, None, self._saved_round) from None
        finally:
            self.executor.close()
            self.folder.unlock()

    def train(self, done: int, stop_after: int | None) -> dict[str, Any]:
        self.folder.open_logs()
        self.sampler.open_log(self.run_dir)
        self._started = time.perf_counter()
        rounds = self.cfg.run.rounds
        last = stop_after if stop_after is not None else rounds
        self.notes = self.health.start_notes()
        for note in self.notes:
            self.warn(note)
        with self.display as display:
            display.start(done)
            if self.on_round is not None:
                self.on_round(done, None)
            for rnd in range(done + 1, last + 1):
                record = None
                try:
                    result = self.train_round(rnd)
                    if rnd % self.cfg.run.eval_every == 0 or rnd == rounds:
                        record = self.evaluate(rnd, result)
                        self.folder.log_metrics(record)
                        self.trackers.log(record)
                        display.evaluated(record)
                    if rnd % self.cfg.run.checkpoint_every == 0 or rnd == last:
                        self.save_checkpoint(rnd, self.wall())
                except RunFailed as err:
                    self.fail(rnd, err)
                except OSError as err:
                    if err.errno not in DISK_FULL:
                        raise
                    self.fail(rnd, self.folder.disk_full(err, rnd, self._saved_round))
                display.advance()
                if self.on_round is not None:
                    self.on_round(rnd, record)
                if self.stop_status is not None and rnd < last:
                    return self.stop(rnd)
        return self.finish(last)

    def request_stop(self, status: str) -> None:
        """End the run after the round being finished, with ``status`` in summary.json (a tuner's trial that its
        pruner stopped: "pruned"); called from ``on_round``. Rounds already finished are kept as they are."""
        self.stop_status = status

    def stop(self, rnd: int) -> dict[str, Any]:
        """The end ``request_stop`` asked for: a checkpoint of round ``rnd`` (so the folder continues like any run:
        ``fedhet resume`` trains it on), then summary.json with the status."""
        if self._saved_round != rnd:
            self.save_checkpoint(rnd, self.wall())
        return self.finish(rnd, status=self.stop_status)

    def train_round(self, rnd: int) -> RoundResult:
        """Every phase of round ``rnd``; raises ``RunFailed`` when the run cannot go on."""
        self.plan = self.system.plan(rnd, self.sampler.sample) if self.system is not None else None
        cids = self.plan.participants if self.plan is not None else self.sampler.sample(rnd)
        self.folder.log_clients(self.plan.record() if self.plan is not None else {"round": rnd, "sampled": cids})
        budgets = self.plan.budgets() if self.plan is not None else {}
        empty: list[str] = []  # the phases that lost every client
        errors = 0  # clients that failed while training, in failures.jsonl
        for phase_idx, phase in enumerate(self.algo.phases):
            result = self.run_phase(rnd, phase_idx, phase, cids, budgets)
            errors += len(result.failures)
            for failure in result.failures:
                self.folder.failures_log.append(failure)
            if result.failures:
                self.display.dropped(rnd, phase, result.failures, len(result.failures) + len(result.replies))
            if not result.replies:
                empty.append(phase)
            bad = nonfinite({"global_params": self.algo.global_params, "global_buffers": self.algo.global_buffers})
            if bad:
                raise RunFailed(f"round {rnd} ({phase}): the global model became non-finite ({', '.join(bad)})")
        self.health.record_round(rnd, empty, self.round_losses(errors) if empty else {})
        if self.system is not None and self.plan is not None:
            self.system.finish(self.plan)
        return result

    def round_losses(self, errors: int) -> dict[str, int]:
        """What took this round's updates: the system model (its plan) and training errors (failures.jsonl)."""
        losses = self.system.lost_updates(self.plan) if self.system is not None and self.plan is not None else {}
        if errors:
            losses[training_errors(self.run_dir / "failures.jsonl")] = errors
        return losses

    def run_phase(
        self, rnd: int, phase_idx: int, phase: str, cids: list[int], budgets: dict[int, int] | None = None
    ) -> RoundResult:
        """One phase: the messages (with each budgeted client's step budget), the clients, the aggregation."""
        if cids:
            msgs = SystemModel.limit(self.algo.configure(rnd, cids, phase), budgets or {})
            replies, failures = self.executor.run_phase(rnd, phase_idx, phase, msgs)
        else:  # the system model left no client in this round
            replies, failures = {}, []
        replies = dict(sorted(replies.items()))  # aggregation order is fixed, whatever order clients ran in
        self.evaluator.observe(phase, replies)  # takes the local models out before the algorithm aggregates
        if replies:
            self.algo.aggregate(rnd, replies, phase)
            self.algo.account(replies)
            self.seen.update(replies)
        else:
            self.algo.aggregate_empty(rnd, phase)
        return RoundResult(replies, failures)

    def evaluate(self, rnd: int, result: RoundResult) -> dict[str, Any]:
        record = self.evaluator.evaluate(rnd, result, self.wall())
        if self.plan is not None:  # the simulated clock and what the system model did to this round
            record.update(self.plan.metrics())
        return record

    def wall(self) -> float:
        """Seconds this run has trained, over its first start and every resume (a resumed run continues the clock)."""
        return self._wall_before + time.perf_counter() - self._started

    def finish(self, last: int, **status: Any) -> dict[str, Any]:
        """summary.json (and the trackers' copy); the warnings the rounds added are printed once more."""
        counted = last + 1 if status.get("status") == "failed" else last  # a failed round counts
        warnings = self.notes + self.health.round_notes(counted, self.seen)
        extra = {"empty_rounds": self.health.empty_rounds, **({"attack": self.attack} if self.attack else {})}
        if self.algo.privacy is not None:
            extra["privacy"] = self.algo.privacy.accounting()
        try:
            summary = self.folder.write_summary(last, self.wall(), extra, warnings, **status)
        except OSError as err:
            if err.errno not in DISK_FULL or status:
                raise
            raise self.folder.disk_full(err, "after the last round", self._saved_round) from None
        self.trackers.finish(summary)
        if not status:
            for note in warnings[len(self.notes) :]:
                self.warn(note)
        return summary

    def fail(self, rnd: int, err: RunFailed) -> None:
        """Write summary.json with status failed (if the disk still takes it) and raise the one-line error."""
        message, kept = str(err), self._saved_round
        if not isinstance(err, DiskFull):
            note = f"the last checkpoint (round {kept}) is kept" if kept else "no checkpoint was written"
            message += f"; stopped, {note}"
        try:
            self.finish(rnd - 1, status="failed", error=message)
        except OSError as again:
            if again.errno not in DISK_FULL:
                raise
            message += " (summary.json could not be written either)"
        raise type(err)(message) from None

    # ------------------------------------------------------------------ the run folder and checkpoints
    def prepare_dir(self, resume: bool, overwrite: bool) -> int:
        """Set up the run folder (fresh, replaced or resumed); returns the last finished round (0 for a fresh run)."""

        def check(state: dict[str, Any]) -> None:  # refused before the folder changes, changing nothing
            if self.system is not None:
                self.system.check_resumable(state)  # a changed trace file
            self.check_data(state)
            check_init(state, self.weights)  # a changed model.init file

        def verify(state: dict[str, Any]) -> None:
            check_state = getattr(self.executor, "check_state", None)
            if check_state is not None:
                check_state(state["executor"])

        def load(state: dict[str, Any]) -> None:
            self.executor.load_state_dict(state["executor"])  # refuses, changing nothing, if its state is gone

        loaded = self.folder.prepare(resume, overwrite, load, Checks(check, verify))
        if self.attack is not None:  # a function of the config, rewritten on every start
            write_json_atomic(self.run_dir / "attack.json", self.attack)
        if self.system is not None:  # so is this (a trace that changed was refused above)
            write_json_atomic(self.run_dir / "system_profiles.json", self.system.describe())
        now = {**environment(), "torch_threads": self.client_threads, "workers": self.workers}
        if loaded is None:
            self.executor.reset()  # a fresh run sees the client states of round 0: none, whatever a crash left
            start = {} if self.weights is None else {"initial_weights": self.weights.record()}
            self.folder.record_environment(None, {**now, **start}, self.fed.provenance, [])
            for note in self.weights.notes if self.weights is not None else []:
                self.display.note(note)
            return 0
        state = loaded.state
        if DATA_KEY not in state:
            self.warn(
                f"{loaded.path} records no fingerprint of its data (an older fedhet wrote it): the data cannot be "
                f"checked against the rounds before it; its next checkpoint records this data's (sha256 "
                f"{self.data_sha256[:12]}...)"
            )
        self.algo.load_state_dict(state["algo"])
        self.seen.update(state["seen"])
        self.evaluator.ema = state["ema"]
        self.health.load_state_dict(state)
        self.sampler.load_state_dict(state)
        if self.system is not None:
            self.system.load_state_dict(state)
        self._wall_before = state["wall_s"]
        self._saved_clients, self._rotate = state["executor"], loaded.path.name == LAST
        self._saved_round = state["round"]
        changes = rounding_changes(state, self.client_threads, self.executor_kind)
        self.folder.record_environment(state["round"], now, self.fed.provenance, changes)
        return state["round"]

    @functools.cached_property
    def data_sha256(self) -> str:
        """The fingerprint of the data the run trains on (``FederatedDataset.fingerprint``): once per process."""
        return self.eval_fed.fingerprint()

    def check_data(self, state: dict[str, Any]) -> None:
        """Refuse (changing nothing) a checkpoint whose rounds trained on other data than this run has loaded:
        the remaining rounds would train on the new data. A checkpoint from before fingerprints passes (with a
        warning once it is taken up)."""
        before, now = state.get(DATA_KEY), self.data_sha256
        if before is not None and before != now:
            raise ConfigError(
                f"{self.eval_fed.describe_source()} has changed since the run was checkpointed (sha256 {before[:12]}"
                f"..., now {now[:12]}...); put the original data back or start a new run"
            )

    def save_checkpoint(self, rnd: int, wall: float) -> None:
        state = {
            "round": rnd,
            "algo": self.algo.state_dict(),
            "executor": self.executor.state_dict(),
            "seen": sorted(self.seen),
            "ema": self.evaluator.ema,
            **self.health.state_dict(),
            "metrics_log": self.folder.metrics_text,
            **self.sampler.state_dict(),
            **(self.system.state_dict() if self.system is not None else {}),
            "wall_s": wall,
            "torch_threads": self.client_threads,
            "executor_kind": self.executor_kind,
            "config": self.resolved,
            DATA_KEY: self.data_sha256,
            LAYOUT_KEY: model_layout(self.flat),  # so a later run can start from this global model (model.init)
        }
        if self.weights is not None and self.weights.sha256 is not None:
            state[INIT_KEY] = self.weights.sha256
        bad = nonfinite(state["algo"])
        if bad:
            raise RunFailed(f"round {rnd}: the server state became non-finite ({', '.join(bad[:5])})")
        write_checkpoint(self.checkpoint_dir, state, rotate=self._rotate)
        # Free saved client state only now that the checkpoints naming it are replaced: last.pt and prev.pt
        # always find theirs, whenever the process is killed.
        self.executor.retain([s for s in (self._saved_clients, state["executor"]) if s is not None])
        self._saved_clients, self._rotate, self._saved_round = state["executor"], True, rnd

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def checkpoint_path(self) -> Path:
        return self.checkpoint_dir / LAST

    @property
    def executor_kind(self) -> str:
        return executor_kind(self.executor)

    def warn(self, text: str) -> None:
        self.display.warn(text)

    # ------------------------------------------------------------------ the parts, as tests and tools reach them
    def sample_clients(self, rnd: int) -> list[int]:
        return self.sampler.sample(rnd)

    def client_performance(self, rnd: int) -> list[float]:
        return self.sampler.client_performance(rnd)

    @property
    def performance(self) -> list[float] | None:
        return self.sampler.performance

    @performance.setter
    def performance(self, value: list[float] | None) -> None:
        self.sampler.performance = value

    def personal_sample(self, rnd: int, seen: list[int]) -> list[int]:
        return self.evaluator.personal_sample(rnd, seen)


# Below this many cores, auto keeps clients in this process: on 2 cores, torch's two intra-op threads trained the
# benchmark's CNN as fast as two worker processes and the demo's MLP faster (docs/performance.md).
AUTO_WORKERS_MIN_CORES = 4


def resolve_workers(cfg: Config) -> int:
    """``run.workers``, with 0 (auto) decided here: one worker per core (at most one per client of a round) on a CPU
    with at least ``AUTO_WORKERS_MIN_CORES`` cores, where intra-op threading no longer scales with the small batches
    of FL clients; else, and on a GPU, clients train in this process. A component defined in ``__main__`` (a script
    or notebook) exists in this process only, so auto keeps its clients here too."""
    from fedhet.engine.workers import main_components

    if cfg.run.workers:
        return cfg.run.workers
    cores, per_round = usable_cores(), cfg.clients_per_round()
    if torch.device(cfg.run.device).type != "cpu" or cores < AUTO_WORKERS_MIN_CORES or per_round < 2:
        return 1
    if main_components(cfg):
        return 1
    return min(cores, per_round)
