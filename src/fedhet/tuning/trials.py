"""One trial of a tune: an ordinary fedhet run folder (``OUT/trials/<number>``) trained with the trial's values,
reporting its validation metric to the pruner at every evaluation, and the worker processes that run trials in
parallel.

Only the tuning process touches the study database: a trial reports through a callback (``report(round, value) ->
prune?``), which in a worker process sends the value through its pipe and waits for the tuning process's answer
(``trial.report`` + ``trial.should_prune`` there). So SQLite sees one writer, however many jobs run.
"""

from __future__ import annotations

import copy
import math
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from fedhet.cells import _DataCache, _forward_warnings, _Lines
from fedhet.config import build_config
from fedhet.errors import FedhetError

Event = tuple[Any, ...]
Report = Callable[[int, float], bool]


@dataclass
class TrialJob:
    number: int
    raw: dict[str, Any]  # the trial's config: run.out_dir = OUT/trials, run.name = its number
    metric: str
    reduce: str
    continued_from: list[int] = field(default_factory=list)  # trials a killed tune left running, oldest first
    seeds: list[int] = field(default_factory=list)  # several tuning seeds: one run per seed (none: run.seed's)


@dataclass
class TrialOutcome:
    number: int
    status: str  # "finished", "pruned" or "failed"
    rounds_done: int
    run_dir: str
    value: float | None = None
    error: str | None = None


def take_over(run_dir: Path, continued_from: list[int]) -> int | None:
    """A trial that continues one a killed tune left running takes its run folder (renamed to this trial's number:
    a moved run folder resumes like any); returns the number whose folder it took."""
    if run_dir.exists():
        return None
    for number in reversed(continued_from):
        old = run_dir.parent / str(number)
        if old.is_dir():
            old.rename(run_dir)
            return number
    return None


def seed_runs(job: TrialJob, folder: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The runs of a trial: its folder, or with several tuning seeds one run folder per seed inside it
    (``trials/<number>/s<seed>``), each an ordinary run."""
    if not job.seeds:
        return [(folder, job.raw)]
    runs = []
    for seed in job.seeds:
        raw = copy.deepcopy(job.raw)
        raw["run"].update(seed=seed, out_dir=str(folder), name=f"s{seed}")
        runs.append((folder / f"s{seed}", raw))
    return runs


def run_trial(job: TrialJob, data: _DataCache, emit: Callable[[Event], None], report: Report) -> TrialOutcome:
    """Train the trial's run(s), continuing any folder it has; every outcome but Ctrl-C is a TrialOutcome. With
    several seeds the first seed's run reports to the pruner (a pruned first run ends the trial), and the objective is
    the mean of the runs' objectives."""
    from fedhet.results.objective import objective

    number, folder = job.number, Path(job.raw["run"]["out_dir"]) / str(job.number)
    rel = f"trials/{number}"
    runs = seed_runs(job, folder)
    run_dir, rounds = runs[0][0], job.raw["run"]["rounds"]
    emit(("start", number, rounds * len(runs)))

    def log(text: str) -> None:
        emit(("log", number, text))

    spent, values = 0, []
    try:
        taken = take_over(folder, job.continued_from)
        if taken is not None:
            log(f"continues trial {taken}, which a killed tune left running (its folder is now {folder})")
        for i, (run_dir, raw) in enumerate(runs):
            summary = train_run(raw, run_dir, data, emit, (number, i * rounds), job.metric, report if i == 0 else None)
            if summary["status"] == "pruned":
                return TrialOutcome(number, "pruned", spent + summary["rounds_done"], rel)
            values.append(objective(run_dir, job.metric, job.reduce))  # type: ignore[arg-type]
            spent += summary["rounds_done"]  # after the objective: a failure below counts run_dir's rounds once
    except FedhetError as err:  # the run failed (diverged), a refused resume: this trial only
        return TrialOutcome(number, "failed", spent + _rounds_done(run_dir), rel, error=str(err))
    except Exception as err:  # a bug or a crash: reported with its traceback, the tune goes on
        log(traceback.format_exc())
        why = f"{type(err).__name__}: {err}"
        return TrialOutcome(number, "failed", spent + _rounds_done(run_dir), rel, error=why)
    value = sum(values) / len(values)
    if math.isnan(value):
        return TrialOutcome(number, "failed", spent, rel, error=f"{job.metric} is NaN (diverged)")
    return TrialOutcome(number, "finished", spent, rel, value=value)


def train_run(
    raw: dict[str, Any],
    run_dir: Path,
    data: _DataCache,
    emit: Callable[[Event], None],
    where: tuple[int, int],
    metric: str,
    report: Report | None,
) -> dict[str, Any]:
    """One run of a trial (resumed where its folder has one), ``metric`` reported at every evaluation when
    ``report`` is given; returns its summary. ``where``: the trial's number and the rounds of its runs before this
    one (for the progress display)."""
    from fedhet.engine.runs import build_simulation

    number, before = where
    raw["run"]["progress"] = False  # the run's own bar would garble the tune's display
    cfg = build_config(raw)
    sim: Any = None

    def log(text: str) -> None:
        emit(("log", number, text))

    started = False

    def on_round(rnd: int, record: dict[str, Any] | None) -> None:
        nonlocal started
        if not started:  # the start: a continued folder's evaluations so far go to the pruner too
            started = True
            for past in _past_values(run_dir, metric, rnd) if report is not None else []:
                report(*past)
            return
        if record is None:  # a round without an evaluation: the progress moves, the pruner hears nothing
            emit(("round", number, before + rnd, None))
            return
        value = _value(record.get(metric))
        emit(("round", number, before + rnd, value))
        if report is not None and metric in record and report(rnd, value) and rnd < cfg.run.rounds:
            sim.request_stop("pruned")

    console = Console(file=_Lines(log), width=1000, color_system=None, force_terminal=False, highlight=False)
    with _forward_warnings(log):
        sim = build_simulation(cfg, fed=data.get(cfg), console=console, on_round=on_round)
        return sim.run(resume=True)


def _value(raw: Any) -> float:
    return math.nan if raw is None else float(raw)


def _past_values(run_dir: Path, metric: str, done: int) -> list[tuple[int, float]]:
    from fedhet.results.store import read_metrics

    path = run_dir / "metrics.jsonl"
    records = read_metrics(path, lambda _: None) if path.exists() else []
    return [(r["round"], _value(r[metric])) for r in records if metric in r and r.get("round", 0) <= done]


def _rounds_done(run_dir: Path) -> int:
    """The rounds a failed trial ran: summary.json's count, else the last evaluated round."""
    from fedhet.results.store import read_json, read_metrics

    try:
        summary = read_json(run_dir / "summary.json")
        return int(summary.get("rounds_done", 0))
    except (OSError, ValueError, FedhetError, AttributeError):
        pass
    try:
        return max((r.get("round", 0) for r in read_metrics(run_dir / "metrics.jsonl", lambda _: None)), default=0)
    except (OSError, FedhetError):
        return 0


# ---------------------------------------------------------------------------------------------- worker processes
def worker(conn: Any, threads: int) -> None:
    """A worker process: runs the trials the tuning process sends until None; progress, output, each report (whose
    answer it waits for) and the outcome go back through ``conn``."""
    from fedhet.engine.workers import orphaned, parent_gone, worker_started

    worker_started()  # Ctrl-C is the parent's; a parent killed outright takes this process with it
    try:
        import torch

        torch.set_num_threads(threads)
        data = _DataCache()
        lock = threading.Lock()  # a warning printed from another thread must not interleave with a report

        def send(event: Event) -> None:
            with lock:
                conn.send(event)

        def report(step: int, value: float) -> bool:
            with lock:
                conn.send(("report", None, step, value))
                return bool(conn.recv())

        for job in iter(conn.recv, None):
            send(("result", run_trial(job, data, send, report)))
    except BaseException:
        if parent_gone():
            orphaned()
        raise
