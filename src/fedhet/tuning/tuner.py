"""``fedhet tune``: search a run's hyper-parameters on validation data with Optuna, at a fixed budget of trials.

The tune folder ``OUT`` holds the study (``study.db``, see ``study.py``), one ordinary run folder per trial
(``trials/<number>``, resumable, readable by ``fedhet report``), and at the end ``tune.json`` and ``tune.md``. A
lock file (``.fedhet-tune.lock``) keeps a second tune out of a folder in use. The tuning process asks Optuna for a
trial's values, hands the trial to itself (``jobs`` 1) or to a worker process, answers its pruning questions and
tells Optuna the outcome: the objective (``fedhet.results.objective``, validation metrics only), PRUNED, or FAIL.
``trials`` is the total: a resumed tune runs only the trials still missing.
"""

from __future__ import annotations

from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedhet.cells import LiveDisplay
from fedhet.config import Config, build_config
from fedhet.errors import ConfigError, RunFailed
from fedhet.results.store import write_json_atomic, write_text_atomic
from fedhet.tuning.space import SearchSpace, build_space, configured
from fedhet.tuning.study import (
    STUDY_FILE,
    TuneSettings,
    best_trial,
    counted,
    grid_size,
    open_study,
    optuna_module,
    requeue_interrupted,
)
from fedhet.tuning.trials import TrialJob, TrialOutcome, run_trial

LOCK_FILE = ".fedhet-tune.lock"
TRIALS_DIR = "trials"
# Optuna's importance evaluator (fANOVA) wants a few completed trials to fit its forest on
IMPORTANCE_MIN_TRIALS = 4


@dataclass
class TunePlan:
    out_dir: Path  # the tune folder
    base: Config  # the trials' config without their values: run.out_dir = OUT/trials
    space: SearchSpace
    settings: TuneSettings
    progress: bool = True  # run.progress of the config tuned: the live display (the trials' own bars are off)
    seeds: list[int] = field(default_factory=list)  # several tuning seeds: a trial runs each (none: run.seed)

    @property
    def rounds_per_trial(self) -> int:
        return self.base.run.rounds * max(len(self.seeds), 1)


@dataclass
class TuneResult:
    """What a tune found: the best trial's values and value, the budget it spent, and where its study is."""

    out_dir: Path
    study_name: str
    storage: str  # sqlite:///OUT/study.db
    metric: str
    reduce: str
    direction: str
    best_trial: int | None
    best_value: float | None
    best_params: dict[str, Any]
    best_run_dir: Path | None
    budget: dict[str, int]
    importances: dict[str, float] = field(default_factory=dict)
    space: str = ""
    at_edge: dict[str, str] = field(default_factory=dict)  # best values at an edge of their range: "lower" | "upper"

    def to_json(self) -> dict[str, Any]:
        return {
            "study_name": self.study_name,
            "storage": self.storage,
            "metric": self.metric,
            "reduce": self.reduce,
            "direction": self.direction,
            "space": self.space,
            "best": {
                "trial": self.best_trial,
                "value": self.best_value,
                "params": self.best_params,
                "run_dir": None if self.best_run_dir is None else str(self.best_run_dir),
            },
            "budget": self.budget,
            "importances": self.importances,
            "at_edge": self.at_edge,
        }


def tune_dir(cfg: Config) -> Path:
    """``run.out_dir/run.name``, or ``run.out_dir/tune-<the run's default name>`` without a name."""
    from fedhet.naming import default_name

    return Path(cfg.run.out_dir) / (cfg.run.name or f"tune-{default_name(cfg)}")


def check_personal_metric(cfg: Config, metric: str) -> None:
    """A personalised metric needs an algorithm with personalised models: else every trial would fail on it."""
    from fedhet.algorithms import ALGORITHMS

    entry = ALGORITHMS.get(cfg.algorithm.name)
    if metric.startswith("val_personal") and entry is not None and not entry.obj.personalized:
        raise ConfigError(
            f"--metric {metric}: {cfg.algorithm.name} has no personalised models (its clients use the global model), "
            "so its runs never log it; tune it on a global metric such as val_acc"
        )


def plan_tune(
    cfg: Config,
    specs: list[str],
    settings: TuneSettings,
    out_dir: Path | None = None,
    seeds: list[int] | None = None,
) -> TunePlan:
    """Every check a tune makes before anything runs: the settings, validation data, the space, the folder.
    ``seeds``: two or more tuning seeds, each trial one run per seed and its objective their mean (default: one run
    on ``run.seed``)."""
    from fedhet.paths import check_folder

    settings.check()
    out_dir = Path(out_dir) if out_dir is not None else tune_dir(cfg)
    check_folder(out_dir, "the tune folder", creatable=True)
    if cfg.partition.validation_fraction <= 0:
        raise ConfigError(
            "tuning needs validation data, and partition.validation_fraction is 0: give it a fraction of each "
            "client's training data, e.g. -s partition.validation_fraction=0.1"
        )
    check_personal_metric(cfg, settings.metric)
    space = build_space(cfg, specs)
    if not space.dims:
        raise ConfigError(
            f"{cfg.algorithm.name} has no tunable parameter of its own: name the settings to tune, e.g. -t train.lr "
            "(fedhet list algorithms shows what each algorithm tunes)"
        )
    if settings.sampler == "grid" and settings.trials > grid_size(space):
        raise ConfigError(
            f"--sampler grid: the grid of {space.describe()} has {grid_size(space)} points, fewer than --trials "
            f"{settings.trials}; give --trials {grid_size(space)} or fewer"
        )
    if not (out_dir / STUDY_FILE).exists() and any((out_dir / TRIALS_DIR).glob("*")):
        raise ConfigError(
            f"{out_dir} holds trial folders but no {STUDY_FILE}: their study is gone, so they cannot be continued; "
            "tune into another folder (--name, --out)"
        )
    raw = cfg.to_dict()
    raw["run"].update(out_dir=str(out_dir / TRIALS_DIR), name=None, progress=False)
    seeds = list(seeds or [])
    if seeds:  # the first is the base's seed (the sampler's, and the trials' without several)
        raw["run"]["seed"] = seeds[0]
    if len(seeds) == 1:  # one seed: each trial is one run folder
        seeds = []
    return TunePlan(out_dir, build_config(raw), space, settings, cfg.run.progress, seeds)


def lock_tune_dir(out_dir: Path) -> FileLock:
    """Claim the tune folder, or refuse: two tunes on one study would both rerun the trials the other is running."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(out_dir / LOCK_FILE, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise ConfigError(
            f"tune folder {str(out_dir)!r} is in use: another fedhet tune is running there (it holds {LOCK_FILE}); "
            "wait for it to end or stop it, or tune into another folder (--name, --out)"
        ) from None
    return lock


def tune(
    plan: TunePlan,
    *,
    jobs: int = 1,
    threads: int | None = None,
    console: Console | None = None,
    progress: bool = True,
) -> TuneResult:
    """Run the trials still missing (see the module docstring) and write tune.json and tune.md; returns the result."""
    return tune_all([("", plan)], jobs=jobs, threads=threads, console=console, progress=progress)[0]


@dataclass(eq=False)
class _Tune:
    """One study of a run of tunes: its plan, its study, the trials it has finished and has running."""

    label: str  # names its trials on the display ("" for a lone tune)
    plan: TunePlan
    study: Any
    finished: int = 0
    running: int = 0
    rerun: list[int] = field(default_factory=list)  # trials a killed tune left running, queued again
    result: TuneResult | None = None

    @property
    def to_start(self) -> int:
        return self.plan.settings.trials - self.finished - self.running

    def end_if_done(self) -> None:
        """Once its last trial has ended, its result and tune.json / tune.md (while the next tune's trials run)."""
        if self.result is None and self.to_start <= 0 and not self.running:
            self.result = summarise(self.study, self.plan)
            write_outputs(self.result, self.plan)


def tune_all(
    plans: list[tuple[str, TunePlan]],
    *,
    jobs: int = 1,
    threads: int | None = None,
    console: Console | None = None,
    progress: bool = True,
) -> list[TuneResult]:
    """Several tunes (a comparison's variants, each labelled) on one pool of ``jobs`` worker processes: a free worker
    takes the next trial of the first tune with a trial still to start. So each tune runs as it would alone (as many
    trials at once as it has left, up to ``jobs``), and the next tune's trials take the workers the ones before it
    cannot use. Each tune keeps its own folder, study and outputs (written when its last trial ends); returns their
    results in order."""
    from fedhet.engine.rundir import usable_cores

    console = console or Console(stderr=True)
    optuna_module()
    with ExitStack() as locks:
        tunes = []
        for label, plan in plans:
            locks.callback(lock_tune_dir(plan.out_dir).release)
            study = open_study(plan.out_dir, plan.base, plan.space, plan.settings, parallel=jobs > 1, seeds=plan.seeds)
            rerun = requeue_interrupted(study)
            tunes.append(_Tune(label, plan, study, finished=len(counted(study)), rerun=rerun))
        todo = sum(max(t.to_start, 0) for t in tunes)
        threads = threads or max(1, usable_cores() // max(jobs, 1))
        enabled = progress and all(plan.progress for _, plan in plans)
        with TuneDisplay(console, tunes, enabled) as display:
            for t in tunes:
                display.opened(t)
                t.end_if_done()  # a tune a killed comparison finished: its summary now, not after the others
            if min(jobs, todo) > 1:
                _run_in_workers(tunes, min(jobs, todo), threads, display)
            elif todo:
                _run_here(tunes, threads, display)
    # every tune has ended by now, at its last trial or at the start when it had none to run: one result each
    return [t.result for t in tunes]


# ---------------------------------------------------------------------------------------------- asking and telling
def next_job(study: Any, plan: TunePlan, in_worker: bool = False) -> tuple[Any, TrialJob]:
    """Ask Optuna for a trial (an enqueued rerun first) and its values; the job that trains it. A trial run in a
    worker process trains its clients there (``run.workers = 1``: a worker may not start processes of its own), as
    compare's cells do."""
    trial = study.ask()
    values = plan.space.suggest(trial)
    raw = configured(plan.base, values).to_dict()
    raw["run"]["name"] = str(trial.number)
    if in_worker:
        raw["run"]["workers"] = 1
    chain = list(trial.user_attrs.get("continued_from", []))
    return trial, TrialJob(trial.number, raw, plan.settings.metric, plan.settings.reduce, chain, list(plan.seeds))


def tell(study: Any, trial: Any, outcome: TrialOutcome) -> None:
    """Record the outcome on the trial (its rounds count in the budget) and finish it in the study."""
    state = optuna_module().trial.TrialState
    trial.set_user_attr("rounds", outcome.rounds_done)
    trial.set_user_attr("run_dir", outcome.run_dir)
    trial.set_user_attr("status", outcome.status)
    if outcome.error:
        trial.set_user_attr("error", outcome.error[:500])
    if outcome.status == "finished":
        study.tell(trial, outcome.value)
    else:
        study.tell(trial, state=state.PRUNED if outcome.status == "pruned" else state.FAIL)


def _reporter(trial: Any) -> Any:
    def report(step: int, value: float) -> bool:
        trial.report(value, step)
        return trial.should_prune()

    return report


def _run_here(tunes: list[_Tune], threads: int, display: TuneDisplay) -> None:
    import torch

    from fedhet.cells import _DataCache

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    data = _DataCache()
    try:
        for t in tunes:
            while t.to_start > 0:
                trial, job = next_job(t.study, t.plan)
                outcome = run_trial(job, data, lambda event, t=t: display.handle(t, event), _reporter(trial))
                tell(t.study, trial, outcome)
                t.finished += 1
                display.finished(t, outcome)
            t.end_if_done()
    finally:
        torch.set_num_threads(before)


@dataclass
class _Slot:
    proc: Any
    conn: Any
    tune: _Tune | None = None  # the tune whose trial it runs
    trial: Any = None  # the Optuna trial it runs, None while it waits


def _run_in_workers(tunes: list[_Tune], workers: int, threads: int, display: TuneDisplay) -> None:
    """Each worker runs one trial at a time; the next is asked for when one ends (TPE learns from every finished
    trial), from the first tune with a trial still to start. A worker that dies fails its trial only; a new one takes
    the trials still to run."""
    from multiprocessing.connection import wait

    from fedhet.cells import _exit_reason, stop_processes
    from fedhet.engine.workers import CONTEXT
    from fedhet.tuning.trials import worker

    slots: list[_Slot] = []

    def start() -> _Slot:
        mine, theirs = CONTEXT.Pipe()
        proc = CONTEXT.Process(target=worker, args=(theirs, threads), name="fedhet-trial", daemon=True)
        proc.start()
        theirs.close()
        return _Slot(proc, mine)

    def waiting() -> _Tune | None:  # the tune whose trial a free worker takes next
        return next((t for t in tunes if t.to_start > 0), None)

    def assign(slot: _Slot, t: _Tune) -> None:
        slot.tune, (slot.trial, job) = t, next_job(t.study, t.plan, in_worker=True)
        t.running += 1
        with suppress(OSError):
            slot.conn.send(job)

    def end(slot: _Slot, outcome: TrialOutcome) -> None:
        t = slot.tune
        assert t is not None
        tell(t.study, slot.trial, outcome)
        slot.tune = slot.trial = None
        t.running -= 1
        t.finished += 1
        display.finished(t, outcome)
        t.end_if_done()

    def read(slot: _Slot) -> bool:
        try:
            while slot.conn.poll():
                event = slot.conn.recv()
                if event[0] == "report":
                    slot.conn.send(_reporter(slot.trial)(event[2], event[3]))
                elif event[0] == "result":
                    end(slot, event[1])
                elif slot.tune is not None:
                    display.handle(slot.tune, event)
        except (EOFError, OSError):
            return False
        return True

    try:
        slots += [start() for _ in range(workers)]
        while any(t.to_start > 0 or t.running for t in tunes):
            for slot in slots:
                t = waiting()
                if slot.proc is not None and slot.trial is None and t is not None:
                    assign(slot, t)
            live = [s for s in slots if s.proc is not None]
            ready = wait([s.conn for s in live] + [s.proc.sentinel for s in live], timeout=1.0)
            for slot in live:
                open_ = read(slot) if slot.conn in ready else True
                if open_ and slot.proc.sentinel not in ready:
                    continue
                read(slot)
                slot.proc.join()
                if slot.trial is not None:
                    why = f"its worker process died ({_exit_reason(slot.proc.exitcode)})"
                    number = slot.trial.number
                    end(slot, TrialOutcome(number, "failed", 0, f"{TRIALS_DIR}/{number}", error=why))
                slot.conn.close()
                fresh = start() if waiting() is not None else None
                slot.proc, slot.conn = (fresh.proc, fresh.conn) if fresh else (None, slot.conn)
        for slot in slots:
            if slot.proc is not None:
                with suppress(OSError):
                    slot.conn.send(None)
                slot.proc.join()
    except BaseException:  # Ctrl-C: stop every worker now; the trials they ran stay RUNNING and are rerun next time
        stop_processes([slot.proc for slot in slots if slot.proc is not None])
        raise


# ---------------------------------------------------------------------------------------------- the result
def budget(study: Any, plan: TunePlan) -> dict[str, int]:
    """Trials and rounds spent: a pruned or failed trial counts the rounds it ran, not ``run.rounds``."""
    trials = counted(study)
    status = [t.user_attrs.get("status") for t in trials]
    rounds = plan.rounds_per_trial
    return {
        "trials": len(trials),
        "complete": status.count("finished"),
        "pruned": status.count("pruned"),
        "failed": len(trials) - status.count("finished") - status.count("pruned"),
        "rounds_per_trial": rounds,
        "rounds_run": sum(int(t.user_attrs.get("rounds", 0)) for t in trials),
        "rounds_nominal": len(trials) * rounds,
    }


def importances(study: Any, space: SearchSpace, complete: int) -> dict[str, float]:
    """Optuna's parameter importances (fANOVA), with two or more parameters and enough completed trials."""
    if len(space.dims) < 2 or complete < IMPORTANCE_MIN_TRIALS:
        return {}
    optuna = optuna_module()
    try:
        found = optuna.importance.get_param_importances(study)
    except (RuntimeError, ValueError, ImportError):  # e.g. every completed trial scored the same
        return {}
    return {key: float(value) for key, value in found.items()}


def summarise(study: Any, plan: TunePlan) -> TuneResult:
    best = best_trial(study)
    spent = budget(study, plan)
    return TuneResult(
        out_dir=plan.out_dir,
        study_name=study.study_name,
        storage=f"sqlite:///{(plan.out_dir / STUDY_FILE).resolve()}",
        metric=plan.settings.metric,
        reduce=plan.settings.reduce,
        direction=plan.settings.direction,
        best_trial=None if best is None else best.number,
        best_value=None if best is None else float(best.value),
        best_params={} if best is None else dict(best.params),
        best_run_dir=None if best is None else plan.out_dir / best.user_attrs.get("run_dir", ""),
        budget=spent,
        importances=importances(study, plan.space, spent["complete"]),
        space=plan.space.describe(),
        at_edge={} if best is None else plan.space.edges(dict(best.params)),
    )


def budget_text(spent: dict[str, int]) -> str:
    """ "8 trials (5 complete, 2 pruned, 1 failed), 19 of 24 rounds" """
    parts = [f"{spent['complete']} complete"] + [f"{spent[k]} {k}" for k in ("pruned", "failed") if spent[k]]
    return (
        f"{spent['trials']} trials ({', '.join(parts)}) x {spent['rounds_per_trial']} rounds: "
        f"{spent['rounds_run']} of {spent['rounds_nominal']} rounds run"
    )


def value_text(value: Any) -> str:
    from fedhet.results.report import format_value

    return f"{value:.4g}" if isinstance(value, float) else format_value(value)


def edge_text(at_edge: dict[str, str]) -> str:
    """ "at the edge of its range: train.lr (lower); the best may lie outside it: widen the range to know" """
    if not at_edge:
        return ""
    sides = ", ".join(f"{key} ({side})" for key, side in at_edge.items())
    return f"at the edge of its range: {sides}; the best may lie outside it: widen the range to know"


def result_markdown(result: TuneResult) -> str:
    lines = [f"# Tune {result.study_name}", ""]
    lines += [f"space: `{result.space}`", f"objective: {result.metric} ({result.reduce}, {result.direction})", ""]
    if result.best_trial is None:
        lines.append("No trial completed.")
    else:
        lines += [
            f"best: trial {result.best_trial}, {result.metric} = {result.best_value:.4f} ({result.best_run_dir})",
            "",
            "| parameter | best value | importance |",
            "|---|---|---|",
        ]
        for key, value in result.best_params.items():
            weight = result.importances.get(key)
            lines.append(f"| `{key}` | {value_text(value)} | {'' if weight is None else f'{weight:.2f}'} |")
        if result.at_edge:
            lines += ["", edge_text(result.at_edge)]
    lines += ["", f"budget: {budget_text(result.budget)}", f"study: {result.storage} (study {result.study_name!r})"]
    return "\n".join(lines) + "\n"


def write_outputs(result: TuneResult, plan: TunePlan) -> None:
    write_json_atomic(plan.out_dir / "tune.json", result.to_json())
    write_text_atomic(plan.out_dir / "tune.md", result_markdown(result))


def print_result(result: TuneResult, console: Console) -> None:
    """The best trial's values (and each parameter's importance), the budget, where the files are."""
    if result.best_trial is None:
        console.print(escape(f"no trial completed; budget: {budget_text(result.budget)}"))
        return
    console.print(
        escape(f"best: trial {result.best_trial}, {result.metric} = {result.best_value:.4f}"), highlight=False
    )
    table = Table()
    table.add_column("parameter")
    table.add_column("best value", justify="right")
    if result.importances:
        table.add_column("importance", justify="right")
    for key, value in result.best_params.items():
        cells = [escape(key), escape(value_text(value))]
        if result.importances:
            cells.append(f"{result.importances.get(key, 0.0):.2f}")
        table.add_row(*cells)
    console.print(table)
    if result.at_edge:
        console.print(escape(edge_text(result.at_edge)), style="yellow", highlight=False)
    console.print(escape(f"budget: {budget_text(result.budget)}"), highlight=False)
    console.print(escape(f"best run: {result.best_run_dir}"), highlight=False)
    console.print(escape(f"study: {result.storage}\nsummary: {result.out_dir / 'tune.json'}, tune.md"), highlight=False)


def raise_if_nothing(result: TuneResult) -> None:
    if result.best_trial is None:
        raise RunFailed(
            f"no trial of the tune in {result.out_dir} completed ({budget_text(result.budget)}); see the trials' "
            "summary.json under trials/"
        )


# ---------------------------------------------------------------------------------------------- display
class TuneDisplay(LiveDisplay):
    """One rich Progress: for each tune, its trials done of its total with the best value and the pruned count, and a
    row per running trial; on a log file, one line per finished trial. Several tunes name their trials by label."""

    def __init__(self, console: Console, tunes: list[_Tune], enabled: bool) -> None:
        first = tunes[0]
        title = escape(self.name(first, "trials"))
        super().__init__(console, title, first.plan.settings.trials, first.finished, enabled)
        self.overalls = {first: self.overall}
        for t in tunes[1:]:
            self.overalls[t] = self.progress.add_task(
                f"[bold]{escape(self.name(t, 'trials'))}", total=t.plan.settings.trials, completed=t.finished, info=""
            )
        self.rows: dict[tuple[str, int], Any] = {}

    @staticmethod
    def name(t: _Tune, what: str) -> str:
        return f"{t.label} {what}" if t.label else what

    def opened(self, t: _Tune) -> None:
        """What a resumed tune found: trials rerun, trials kept."""
        where = f"{t.label}: " if t.label else ""
        if t.rerun:
            self.note(f"{where}rerunning trial(s) {', '.join(map(str, t.rerun))}, which a killed tune left running")
        if t.finished:
            self.note(f"{where}{t.finished} of {t.plan.settings.trials} trials had finished before: kept")
        self.update(t)

    def handle(self, t: _Tune, event: tuple[Any, ...]) -> None:
        kind, number = event[0], event[1]
        key = (t.label, number)
        if kind == "start":
            label = escape(self.name(t, f"trial {number}"))
            self.rows[key] = self.progress.add_task(label, total=event[2], completed=0, info="")
        elif kind == "round" and key in self.rows:
            if event[3] is None:  # a round without an evaluation
                self.progress.update(self.rows[key], completed=event[2])
            else:
                info = f"{t.plan.settings.metric} {event[3]:.4f}"
                self.progress.update(self.rows[key], completed=event[2], info=info)
        elif kind == "log":
            name = escape(self.name(t, f"trial {number}"))
            self.console.print(f"[yellow]{name}[/]: {escape(event[2])}", highlight=False, soft_wrap=True)

    def update(self, t: _Tune) -> None:
        trials = counted(t.study)
        best = best_trial(t.study)
        pruned = sum(trial.user_attrs.get("status") == "pruned" for trial in trials)
        info = f"best {best.value:.4f} (trial {best.number})" if best is not None else "best —"
        info += f", {pruned} pruned"
        self.progress.update(self.overalls[t], completed=len(trials), info=info)

    def finished(self, t: _Tune, outcome: TrialOutcome) -> None:
        key = (t.label, outcome.number)
        if key in self.rows:
            self.progress.remove_task(self.rows.pop(key))
        name = escape(self.name(t, f"trial {outcome.number}"))
        metric = t.plan.settings.metric
        if outcome.status == "finished":
            text = f"[green]{name}[/]: {metric} {outcome.value:.4f}"
        elif outcome.status == "pruned":
            text = f"[yellow]{name}[/]: pruned after round {outcome.rounds_done}"
        else:
            text = f"[red]{name} failed[/]: {escape(outcome.error or '')}"
        trial = next((tr for tr in t.study.get_trials(deepcopy=False) if tr.number == outcome.number), None)
        if trial is not None and trial.params:
            text += escape(" (" + ", ".join(f"{k}={value_text(v)}" for k, v in trial.params.items()) + ")")
        self.console.print(text, highlight=False, soft_wrap=True)
        self.update(t)
