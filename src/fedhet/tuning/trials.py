"""One trial of a tune: an ordinary fedhet run folder (``OUT/trials/<number>``) trained with the trial's values,
reporting its validation metric to the pruner at every evaluation, and the worker processes that run trials in
parallel.

Only the tuning process touches the study database: a trial reports through a callback (``report(round, value) ->
prune?``), which in a worker process sends the value through its pipe and waits for the tuning process's answer
(``trial.report`` + ``trial.should_prune`` there). So SQLite sees one writer, however many jobs run.
"""

from __future__ import annotations

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


def run_trial(job: TrialJob, data: _DataCache, emit: Callable[[Event], None], report: Report) -> TrialOutcome:
    """Train the trial's run (continuing its folder if it has one); every outcome but Ctrl-C is a TrialOutcome."""
    from fedhet.engine.runs import build_simulation

    job.raw["run"]["progress"] = False  # the run's own bar would garble the tune's display
    number = job.number
    run_dir = Path(job.raw["run"]["out_dir"]) / str(number)
    rel = f"trials/{number}"
    emit(("start", number, job.raw["run"]["rounds"]))

    def log(text: str) -> None:
        emit(("log", number, text))

    console = Console(file=_Lines(log), width=1000, color_system=None, force_terminal=False, highlight=False)
    sim: Any = None
    try:
        taken = take_over(run_dir, job.continued_from)
        if taken is not None:
            log(f"continues trial {taken}, which a killed tune left running (its folder is now {run_dir})")
        cfg = build_config(job.raw)
        rounds = cfg.run.rounds

        def on_round(rnd: int, record: dict[str, Any] | None) -> None:
            if record is None:  # the start: a continued folder's evaluations so far go to the pruner too
                for past in _past_values(run_dir, job.metric, rnd):
                    report(*past)
                return
            value = _value(record.get(job.metric))
            emit(("round", number, rnd, value))
            if job.metric in record and report(rnd, value) and rnd < rounds:
                sim.request_stop("pruned")

        with _forward_warnings(log):
            sim = build_simulation(cfg, fed=data.get(cfg), console=console, on_round=on_round)
            summary = sim.run(resume=True)
    except FedhetError as err:  # the run failed (diverged), a refused resume: this trial only
        return TrialOutcome(number, "failed", _rounds_done(run_dir), rel, error=str(err))
    except Exception as err:  # a bug or a crash: reported with its traceback, the tune goes on
        log(traceback.format_exc())
        return TrialOutcome(number, "failed", _rounds_done(run_dir), rel, error=f"{type(err).__name__}: {err}")
    if summary["status"] == "pruned":
        return TrialOutcome(number, "pruned", summary["rounds_done"], rel)
    from fedhet.results.objective import objective

    value = objective(run_dir, job.metric, job.reduce)  # type: ignore[arg-type]
    if math.isnan(value):
        return TrialOutcome(number, "failed", summary["rounds_done"], rel, error=f"{job.metric} is NaN (diverged)")
    return TrialOutcome(number, "finished", summary["rounds_done"], rel, value=value)


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
