"""Many runs at once: cells in worker processes, finished ones skipped, killed ones resumed, one progress display.

A *cell* is one ordinary run: a ``Config`` whose folder is ``run.out_dir/run.name``. ``run_cells`` first looks at
every cell's folder, without loading any data:

- no run there: the cell starts;
- a run of the same resolved config that finished ``run.rounds`` rounds or more: skipped;
- any other run of the same config (killed, stopped, failed, or finished with fewer rounds): continued with
  ``Simulation.run(resume=True)``, from its last checkpoint, bit for bit, or extended;
- a run of another config: an error naming the cell and the settings that differ, before anything trains.

``overwrite=True`` replaces every cell's run instead.

Cells run in ``jobs`` worker processes started with "spawn" (a process whose torch threads exist must not fork),
each with ``threads`` torch threads set before any work. The workers (``fedhet.engine.workers.CONTEXT``) never
import the caller's ``__main__``, so ``fedhet.compare(jobs=2)`` works from a script without ``if __name__ ==
"__main__":`` and from a notebook; a component registered in ``__main__`` is refused, in one line, before any
starts. With one worker (or one cell to run) cells run in this process under the same thread count. A cell's results
depend on its config and thread count only, not on where it ran (the engine derives every random stream from the
seed, round and client). A worker keeps the federated data of its last cell, and cells that share data are queued
together, so each worker loads a data set once. Workers send their progress, console output (warnings) and results
through their pipes to a single rich display. A failed cell is reported and the others go on. Ctrl-C stops every
worker at once (they never see SIGINT: the parent alone handles it): a checkpoint is complete whenever
a process dies, so running the same cells again continues them. A parent killed outright takes its workers with it,
and they remove its temporary folder.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedhet.config import Config, build_config
from fedhet.engine.rundir import usable_cores
from fedhet.errors import ConfigError, FedhetError
from fedhet.naming import run_dir as run_dir_of

Event = tuple[Any, ...]


def parse_jobs(text: str | int, option: str = "--jobs") -> int:
    """``--jobs`` (``jobs=`` in the Python API): a number of worker processes, or ``0`` / ``auto`` for one per usable
    core."""
    value = "" if isinstance(text, bool) else str(text).strip().lower()
    if value in ("0", "auto"):
        return usable_cores()
    try:
        jobs = int(value)
    except ValueError:
        jobs = -1
    if jobs < 1:
        raise ConfigError(
            f"{option} {text!r}: give a number of worker processes, or 0 or auto for one per usable core "
            f"({usable_cores()} here)"
        )
    return jobs


@dataclass(frozen=True)
class Cell:
    name: str  # how the display and the messages call it, e.g. "alpha0.1/fedprox-s0"
    config: Config

    @property
    def run_dir(self) -> Path:
        return run_dir_of(self.config)


@dataclass
class CellResult:
    name: str
    run_dir: Path
    status: str  # "skipped" (it had finished before), "finished", "stopped" or "failed"
    rounds_done: int = 0
    final: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def has_metrics(self) -> bool:
        return (self.run_dir / "metrics.jsonl").exists()


# a cell whose folder holds a run of this config under plug-in code that changed since (not accepted)
PLUGIN_CHANGED = "plug-in changed"


@dataclass(frozen=True)
class CellState:
    action: str  # "start", "skip", "resume", "conflict" (another config) or PLUGIN_CHANGED
    detail: str = ""
    rounds_done: int = 0
    accepted: bool = False  # it goes on under plug-in code that changed since, as --accept-changed-plugins allows


def cell_state(cell: Cell, warn: Callable[[str], None]) -> CellState:
    """What running ``cell`` would do with what its folder holds; reads only small JSON files, never data. ``warn``
    gets a torn last line of its metrics.jsonl (as a run's own warnings do)."""
    from fedhet.engine.rundir import holds_run
    from fedhet.engine.simulation import config_changes, resolve_config
    from fedhet.results.store import read_json, read_metrics

    folder = cell.run_dir
    if not holds_run(folder):
        return CellState("start")
    try:
        saved = read_json(folder / "config.json")
    except (OSError, ValueError):
        saved = None  # no readable config: the engine decides whether the folder can be resumed
    if isinstance(saved, dict):
        changed = config_changes(saved, resolve_config(cell.config))
        if changed:
            return CellState("conflict", ", ".join(changed))
    from fedhet import plugins
    from fedhet.components import plugins_in_use

    # a finished cell is not skipped, nor a killed one resumed, under new code of a plug-in it runs, unless accepted
    diffs = plugins.changed(plugins.saved_fingerprints(folder), plugins_in_use(cell.config))
    if diffs and not plugins.accepting_changes():
        return CellState(PLUGIN_CHANGED, "; ".join(diffs))
    accepted = bool(diffs)
    try:
        summary = read_json(folder / "summary.json")
    except (OSError, ValueError):
        summary = {}
    done = summary.get("rounds_done", 0) if isinstance(summary, dict) else 0
    if isinstance(summary, dict) and summary.get("status") == "finished":
        if done >= cell.config.run.rounds:
            return CellState("skip", f"finished round {done}", done, accepted)
        return CellState("resume", f"finished round {done}, extend", done)
    if isinstance(summary, dict) and summary.get("status") == "failed":
        return CellState("resume", f"failed after round {done}, retry from its last checkpoint", done)
    try:
        last = max((r["round"] for r in read_metrics(folder / "metrics.jsonl", warn)), default=0)
    except FedhetError:
        last = 0
    return CellState("resume", f"metrics to round {last}" if last else "no metrics yet", last)


def check_conflicts(cells: list[Cell], states: dict[str, CellState]) -> None:
    """One error for every cell whose folder holds a run of another config."""
    bad = [f"{c.name} ({states[c.name].detail})" for c in cells if states[c.name].action == "conflict"]
    if bad:
        raise ConfigError(
            f"{len(bad)} cell(s) already hold a run of a different config: {'; '.join(bad)}; only run.rounds "
            "may grow on a rerun: replace them with --overwrite, or choose another run.out_dir"
        )
    edited = [f"{c.name} ({states[c.name].detail})" for c in cells if states[c.name].action == PLUGIN_CHANGED]
    if edited:
        from fedhet.plugins import ACCEPT_FLAG

        raise ConfigError(
            f"{len(edited)} cell(s) ran plug-in code that changed since: {'; '.join(edited)}; restore it, pass "
            f"{ACCEPT_FLAG} to continue them under the new code, or rerun them with --overwrite"
        )


def data_key(cfg: Config) -> str:
    """Cells with equal keys train on the same federated data (what ``build_federation`` depends on)."""
    raw = cfg.to_dict()
    seed = cfg.run.seed if cfg.partition.seed is None else cfg.partition.seed
    return json.dumps([raw["dataset"], raw["partition"], seed, cfg.run.device], sort_keys=True)


def by_data(cells: list[Cell]) -> list[Cell]:
    """Cells grouped by data set (in order of first appearance), each group in the given order."""
    first: dict[str, int] = {}
    keys = [first.setdefault(data_key(c.config), len(first)) for c in cells]
    return [c for _, _, c in sorted(zip(keys, range(len(cells)), cells, strict=True), key=lambda t: t[:2])]


def run_cells(
    cells: list[Cell],
    *,
    jobs: int | str = 1,
    threads: int | None = None,
    overwrite: bool = False,
    console: Console | None = None,
    progress: bool = True,
) -> list[CellResult]:
    """Run every cell that has not finished (see the module docstring); returns one result per cell, in order.

    ``jobs``: worker processes (0 or "auto": one per usable core). ``threads``: torch threads per cell (default:
    usable cores // jobs, at least 1). Raises ``ConfigError`` before anything trains when cells share a folder, a
    folder holds a run of another config, or cells to run in workers use a component registered in ``__main__``."""
    console = console or Console(stderr=True)
    jobs = parse_jobs(jobs, "jobs")
    folders: dict[Path, str] = {}
    for c in cells:
        other = folders.setdefault(c.run_dir.resolve(), c.name)
        if other != c.name:
            raise ConfigError(f"cells {other} and {c.name} would share the run folder {c.run_dir}")
    # silent about a torn metrics line: the cell's resume says it, once, among the cell's lines
    states = {c.name: CellState("start") if overwrite else cell_state(c, lambda _: None) for c in cells}
    check_conflicts(cells, states)
    threads = threads or max(1, usable_cores() // jobs)
    skipped = {
        c.name: CellResult(c.name, c.run_dir, "skipped", states[c.name].rounds_done)
        for c in cells
        if states[c.name].action == "skip"
    }
    for c in cells:
        if c.name in skipped and states[c.name].accepted:
            from fedhet.engine.runfolder import record_accepted_plugins

            record_accepted_plugins(c.run_dir, c.config)
    todo = by_data([c for c in cells if c.name not in skipped])
    if min(jobs, len(todo)) > 1:
        from fedhet.engine.workers import check_workers_can_build

        check_workers_can_build([c.config for c in todo], "run with jobs=1")
    with _Display(console, total=len(cells), done=len(skipped), enabled=progress) as display:
        if skipped:
            names = ", ".join(list(skipped)[:6]) + (", ..." if len(skipped) > 6 else "")
            display.note(f"{len(skipped)} of {len(cells)} cells had finished before: skipped ({names})")
        raws = {c.name: cell_raw(c, jobs) for c in todo}
        if min(jobs, len(todo)) <= 1:
            results = _run_here(todo, raws, threads, overwrite, display)
        else:
            results = _run_in_workers(todo, raws, min(jobs, len(todo)), threads, overwrite, display)
    by_name = {**skipped, **{r.name: r for r in results}}
    return [by_name[c.name] for c in cells]


# ---------------------------------------------------------------------------------------------- one cell
def cell_raw(cell: Cell, jobs: int) -> dict[str, Any]:
    """The config a cell runs with. With ``jobs`` above 1 the cells are the parallel unit: their clients train in the
    process that runs the cell (``run.workers = 1``; a worker process may not start processes of its own), with one
    thread count, so a cell trains and records the same whether a worker or this process runs it (a lone cell left
    to run does not start worker processes)."""
    raw = cell.config.to_dict()
    if jobs > 1:
        raw["run"]["workers"] = 1
    return raw


class _DataCache:
    """The federated data of the last cell, reused by the next cell with the same data set and split."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.fed: Any = None

    def get(self, cfg: Config) -> Any:
        from fedhet.engine.simulation import build_federation

        key = data_key(cfg)
        if key != self.key:
            self.key = self.fed = None  # let the old one go before loading the next
            self.fed = build_federation(cfg)
            self.key = key
        return self.fed


class _Lines:
    """A file for a rich Console that sends what each print wrote as one text."""

    def __init__(self, send: Callable[[str], None]) -> None:
        self.send, self.buffer = send, []

    def write(self, text: str) -> int:
        self.buffer.append(text)
        return len(text)

    def flush(self) -> None:
        text, self.buffer = "".join(self.buffer).rstrip("\n"), []
        if text:
            self.send(text)

    def isatty(self) -> bool:
        return False


@contextmanager
def _forward_warnings(send: Callable[[str], None]) -> Iterator[None]:
    """Python warnings (a library's, say) go to the display with the cell's name, not to raw stderr."""
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        send(f"warning: {message}")

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


def _run_cell(name: str, raw: dict[str, Any], overwrite: bool, data: _DataCache, emit: Callable[[Event], None]):
    """Run one cell wherever this is called; every outcome but Ctrl-C becomes a CellResult."""
    from fedhet.engine.runs import build_simulation

    raw["run"]["progress"] = False  # the cell's own bar would garble the shared display
    cfg = build_config(raw)
    run_dir = run_dir_of(cfg)
    emit(("start", name, os.getpid(), cfg.run.rounds))

    def log(text: str) -> None:
        emit(("log", name, text))

    def on_round(rnd: int, record: dict[str, Any] | None) -> None:
        emit(("round", name, rnd, None if record is None else record.get("test_acc")))

    console = Console(file=_Lines(log), width=1000, color_system=None, force_terminal=False, highlight=False)
    try:
        with _forward_warnings(log):
            sim = build_simulation(cfg, fed=data.get(cfg), console=console, on_round=on_round)
            summary = sim.run(resume=not overwrite, overwrite=overwrite)
    except FedhetError as err:  # RunFailed, a refused resume, a missing data set: this cell only
        return CellResult(name, run_dir, "failed", error=str(err))
    except Exception as err:  # a bug or a crash (out of memory): report it with its traceback, go on
        log(traceback.format_exc())
        return CellResult(name, run_dir, "failed", error=f"{type(err).__name__}: {err}")
    return CellResult(name, run_dir, summary["status"], summary["rounds_done"], summary.get("final", {}))


def _run_here(
    todo: list[Cell], raws: dict[str, dict[str, Any]], threads: int, overwrite: bool, display: _Display
) -> list[CellResult]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    data = _DataCache()
    results = []
    try:
        for cell in todo:
            result = _run_cell(cell.name, raws[cell.name], overwrite, data, display.handle)
            display.handle(("result", result))
            results.append(result)
    finally:
        torch.set_num_threads(before)
    return results


# ---------------------------------------------------------------------------------------------- workers


def _worker(conn: Any, threads: int) -> None:
    """A worker process: run the cells the parent sends through ``conn`` until None; everything it has to say (progress,
    console output, results) goes back through ``conn``."""
    from fedhet.engine.workers import orphaned, parent_gone, worker_started

    # Ctrl-C in a terminal reaches the whole process group: the parent alone decides, and stops the workers; a parent
    # killed outright (SIGKILL, SIGTERM) takes its workers with it
    worker_started()
    try:
        import torch

        torch.set_num_threads(threads)
        data = _DataCache()
        lock = threading.Lock()  # a warning printed from another thread must not interleave with a round's event

        def send(event: Event) -> None:
            with lock:
                conn.send(event)

        for name, raw, overwrite in iter(conn.recv, None):  # raw: cell_raw's, run.workers = 1
            send(("result", _run_cell(name, raw, overwrite, data, send)))
    except BaseException:
        if parent_gone():  # talking to a parent that was killed: nothing to report, no traceback
            orphaned()
        raise


@dataclass
class _Slot:
    """A worker process, its end of the pipe, and the cell it runs (None while it waits for one)."""

    proc: Any
    conn: Any
    cell: str | None = None
    waiting: bool = True  # it has no cell and was not told to end


def _run_in_workers(
    todo: list[Cell], raws: dict[str, dict[str, Any]], workers: int, threads: int, overwrite: bool, display: _Display
) -> list[CellResult]:
    """Each worker gets one cell at a time through its own pipe, the next when it reports a result; a worker that
    dies fails its cell only, and a new one takes the cells still to run. Pipes, not queues: no named semaphore to
    leak when this process is killed."""
    from multiprocessing.connection import wait

    from fedhet.engine.workers import CONTEXT

    pending = list(todo)  # in order: cells that share data follow each other, so a worker loads each data set once
    results: dict[str, CellResult] = {}
    slots: list[_Slot] = []

    def start() -> _Slot:
        mine, theirs = CONTEXT.Pipe()
        proc = CONTEXT.Process(target=_worker, args=(theirs, threads), name="fedhet-cell", daemon=True)
        proc.start()
        theirs.close()
        return _Slot(proc, mine)

    def give(slot: _Slot) -> None:
        """The next cell, or None: the worker ends."""
        cell = pending.pop(0) if pending else None
        slot.cell, slot.waiting = (None if cell is None else cell.name), False
        with suppress(OSError):  # it died: its sentinel says so
            slot.conn.send(None if cell is None else (cell.name, raws[cell.name], overwrite))

    def handle(slot: _Slot, event: Event) -> None:
        if event[0] == "result":
            results[event[1].name] = event[1]
            slot.cell, slot.waiting = None, True
        display.handle(event)

    def read(slot: _Slot) -> bool:
        """Handle what the worker sent; False once its pipe is closed (it ended or died)."""
        try:
            while slot.conn.poll():
                handle(slot, slot.conn.recv())
        except (EOFError, OSError):
            return False
        return True

    try:
        slots += [start() for _ in range(workers)]
        while len(results) < len(todo):
            live = [s for s in slots if s.proc is not None]
            for slot in live:
                if slot.waiting:
                    give(slot)
            ready = wait([s.conn for s in live] + [s.proc.sentinel for s in live], timeout=1.0)
            for slot in live:
                open_ = read(slot) if slot.conn in ready else True
                if open_ and slot.proc.sentinel not in ready:
                    continue
                read(slot)  # what it sent before it ended
                slot.proc.join()
                if slot.cell is not None and slot.cell not in results:
                    cell = next(c for c in todo if c.name == slot.cell)
                    why = f"its worker process died ({_exit_reason(slot.proc.exitcode)})"
                    results[cell.name] = CellResult(cell.name, cell.run_dir, "failed", error=why)
                    display.handle(("result", results[cell.name]))
                slot.conn.close()
                if pending:  # a new worker takes the cells still to run
                    fresh = start()
                    slot.proc, slot.conn, slot.cell, slot.waiting = fresh.proc, fresh.conn, None, True
                else:
                    slot.proc, slot.cell, slot.waiting = None, None, False
        for slot in slots:  # every cell has its result: the workers end
            if slot.proc is not None:
                if slot.waiting:
                    give(slot)
                slot.proc.join()
    except BaseException:  # Ctrl-C (or a bug here): stop every worker now, mid-round; their checkpoints are whole
        stop_processes([slot.proc for slot in slots if slot.proc is not None])
        raise
    return [results[c.name] for c in todo]


def stop_processes(procs: list) -> None:
    """Terminate worker processes now (SIGTERM), then kill any still alive after 10 s, and reap them all."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.join(10)
        if proc.exitcode is None:
            proc.kill()
            proc.join()


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (", out of memory?" if name == "SIGKILL" else "")
    return f"exit status {code}"


# ---------------------------------------------------------------------------------------------- display


class LiveDisplay:
    """A rich Progress with an overall row (``what`` done of ``total``) above a row per running job; messages print
    above it; on a log file (not a terminal, or ``enabled`` off) it shows nothing. Compare's cells and the tuner's
    trials each extend it with the events they handle."""

    def __init__(self, console: Console, what: str, total: int, done: int, enabled: bool) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
            disable=not (enabled and console.is_terminal),  # a log file gets the per-job lines only
            transient=True,
        )
        self.overall = self.progress.add_task(f"[bold]{what}", total=total, completed=done, info="")

    def __enter__(self) -> LiveDisplay:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def note(self, text: str) -> None:
        self.console.print(escape(text), highlight=False, soft_wrap=True)


class _Display(LiveDisplay):
    """One rich Progress for every cell: a row per running cell and an overall row; messages print above it."""

    def __init__(self, console: Console, total: int, done: int, enabled: bool) -> None:
        super().__init__(console, "cells", total, done, enabled)
        self.rows: dict[str, Any] = {}  # running cell -> its progress row
        self.info: dict[str, str] = {}  # running cell -> its last accuracy
        self.failed = 0

    def handle(self, event: Event) -> None:
        kind, name = event[0], event[1] if event[0] != "result" else event[1].name
        if kind == "start":
            self.rows[name] = self.progress.add_task(escape(name), total=event[3], completed=0, info="loading")
        elif kind == "round" and name in self.rows:
            _, _, rnd, acc = event
            if acc is not None:
                self.info[name] = f"acc {100 * acc:.2f}%"
            self.progress.update(self.rows[name], completed=rnd, info=self.info.get(name, ""))
        elif kind == "log":
            self.console.print(f"[yellow]{escape(name)}[/]: {escape(event[2])}", highlight=False, soft_wrap=True)
        elif kind == "result":
            self.finish(event[1])

    def finish(self, result: CellResult) -> None:
        if result.name in self.rows:
            self.progress.remove_task(self.rows.pop(result.name))
            self.info.pop(result.name, None)
        name = escape(result.name)
        if result.status == "failed":
            self.failed += 1
            self.console.print(f"[red]failed[/] {name}: {escape(result.error or '')}", highlight=False, soft_wrap=True)
        else:
            acc = result.final.get("test_acc")
            text = f", test_acc={100 * acc:.2f}%" if acc is not None else ""
            self.console.print(
                f"[green]{result.status}[/] {name}: round {result.rounds_done}{text}", highlight=False, soft_wrap=True
            )
        info = f"[red]{self.failed} failed" if self.failed else ""
        self.progress.update(self.overall, advance=1, info=info)
