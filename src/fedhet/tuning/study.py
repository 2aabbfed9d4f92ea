"""The Optuna study behind ``fedhet tune``: its SQLite database in the tune folder, the settings it was made for,
the samplers and pruners, and the bookkeeping that makes a killed tune resume without rerunning or duplicating a
finished trial.

The study lives in ``OUT/study.db`` (Optuna's RDB storage, ``sqlite:///OUT/study.db``), which ``optuna.load_study``
reads as any study. Its user attribute ``fedhet`` records what it was made for (the trials' resolved config, the
search space, the objective), so a tune started on that folder with other settings is refused before anything runs.

A trial that was running when its tune was killed is still RUNNING in the database. The next tune (which holds the
folder's lock, so no other tune is running) enqueues it again with the same parameters and the user attribute
``continues`` = its number, then marks it FAIL: the new trial takes over its run folder (renamed to the new number)
and resumes it from its checkpoint. Such a FAIL has a successor and counts for nothing; every other finished trial
(COMPLETE, PRUNED, or FAIL for a run that failed) counts towards ``--trials`` and its rounds towards the budget.
Optuna is imported here only when a function runs (``pip install fedhet[tune]``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from fedhet.config import Config
from fedhet.errors import ConfigError
from fedhet.results.objective import (
    REDUCE_CHOICES,
    STUDY_FILE,
    check_objective_metric,
    direction,
    reduce_window,
)
from fedhet.tuning.space import Choice, IntRange, LogUniform, SearchSpace

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("none", "median", "hyperband")
# the validation metrics a run logs (toolkit.evaluate.validation_metrics)
METRICS = (
    "val_acc",
    "val_loss",
    "val_client_acc_mean",
    "val_client_acc_std",
    "val_client_acc_min",
    "val_client_acc_max",
    "val_client_acc_worst10",
    "val_acc_smallest_client",
    "val_acc_largest_client",
    # a personalised method's clients' own models on their own validation data (engine/evaluation.py)
    "val_personal_acc_micro",
    "val_personal_acc_macro",
    "val_personal_leaky_acc_micro",  # Per-FedAvg's and Per-FedBC's leaky evaluation
    "val_personal_leaky_acc_macro",
)
# a grid sampler's points per float range (log ranges: geometric), and at most this many per integer range
GRID_POINTS = 3
GRID_INT_POINTS = 5
# SQLite waits this long (s) for another connection's write lock instead of failing at once ("database is locked")
SQLITE_TIMEOUT_S = 60
SCHEMA_RACE_TRIES = 5  # opening a new study.db while another process creates its tables


@dataclass(frozen=True)
class TuneSettings:
    """How a tune searches: the total number of trials, the objective, the sampler and the pruner."""

    trials: int
    metric: str = "val_acc"
    reduce: str = "last"
    sampler: str = "tpe"
    pruner: str = "median"

    def check(self) -> None:
        """One line for each setting out of range, before anything runs."""
        check_objective_metric(self.metric)  # a test metric: refused, "tuning reads validation metrics only"
        if self.metric not in METRICS:
            raise ConfigError(f"unknown validation metric {self.metric!r}; choose one of: {', '.join(METRICS)}")
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ConfigError(f"--trials {self.trials!r}: give the number of trials to run in all, 1 or more")
        try:
            reduce_window(self.reduce)
        except ConfigError:
            raise ConfigError(f"unknown --reduce {self.reduce!r}; choose {REDUCE_CHOICES}") from None
        for name, value, valid in (
            ("--sampler", self.sampler, SAMPLERS),
            ("--pruner", self.pruner, PRUNERS),
        ):
            if value not in valid:
                raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(valid)}")

    @property
    def direction(self) -> str:
        return direction(self.metric)


def optuna_module() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError("tuning needs Optuna: pip install 'fedhet[tune]' (or pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # its INFO line per trial would garble the display
    return optuna


def storage(out_dir: Path) -> Any:
    """The study's RDB storage, ``sqlite:///OUT/study.db``, waiting for a lock rather than failing at once."""
    optuna = optuna_module()
    out_dir.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{(out_dir / STUDY_FILE).resolve()}"
    # Opening a new database creates its tables; two processes doing so at once collide ("table already exists",
    # a duplicate schema version), so fedhet's processes take turns, and one that meets another program's creation
    # opens it again once the tables are complete.
    with FileLock(out_dir / f".{STUDY_FILE}.lock"):
        for attempt in range(SCHEMA_RACE_TRIES):
            try:
                return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": SQLITE_TIMEOUT_S}})
            except Exception as err:  # sqlalchemy's: not a database, a newer schema, a file that cannot be read
                if _schema_race(err) and attempt + 1 < SCHEMA_RACE_TRIES:
                    time.sleep(0.2 * (attempt + 1))
                    continue
                raise ConfigError(
                    f"{out_dir / STUDY_FILE} is not an Optuna study database fedhet can use: {err}"
                ) from None
    raise AssertionError("unreachable")


def _schema_race(err: Exception) -> bool:
    text = str(err)
    return "already exists" in text or "UNIQUE constraint failed: alembic_version" in text


# ---------------------------------------------------------------------------------------------- samplers, pruners
def grid_space(space: SearchSpace) -> dict[str, list[Any]]:
    """The points a grid sampler tries per dimension: every choice; an integer range's values (at most
    ``GRID_INT_POINTS``, evenly or geometrically spaced); ``GRID_POINTS`` points of a float range, both ends in."""
    grid: dict[str, list[Any]] = {}
    for dim in space.dims:
        dist = dim.dist
        if isinstance(dist, Choice):
            grid[dim.key] = list(dist.values)
        elif isinstance(dist, IntRange):
            count = min(GRID_INT_POINTS, dist.high - dist.low + 1)
            spaced = np.geomspace if dist.log else np.linspace
            grid[dim.key] = sorted({int(round(v)) for v in spaced(dist.low, dist.high, count)})
        else:
            spaced = np.geomspace if isinstance(dist, LogUniform) else np.linspace
            inner = spaced(dist.low, dist.high, GRID_POINTS)[1:-1]
            grid[dim.key] = [float(dist.low), *(float(f"{v:.6g}") for v in inner), float(dist.high)]
    return grid


def grid_size(space: SearchSpace) -> int:
    return math.prod(len(v) for v in grid_space(space).values())


def make_sampler(kind: str, space: SearchSpace, seed: int, parallel: bool) -> Any:
    """TPE (``constant_liar`` when trials run in parallel, so running ones are not proposed twice), random, or grid,
    each seeded."""
    optuna = optuna_module()
    if kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if kind == "grid":
        return _grid_sampler(optuna)(grid_space(space), seed=seed)
    return optuna.samplers.TPESampler(seed=seed, constant_liar=parallel)


def _grid_sampler(optuna: Any) -> type:
    class AskTellGrid(optuna.samplers.GridSampler):
        """Optuna's grid sampler, minus its ``study.stop()`` once the grid is covered: that works inside
        ``study.optimize`` only, and raised in the tell of the last point here (``--trials`` ends the tune)."""

        def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
            return None

    return AskTellGrid


def make_pruner(kind: str, rounds: int) -> Any:
    """Median: a trial whose value at a round is worse than the median of earlier trials' at that round stops
    (after 5 trials, Optuna's default); hyperband: successive halving over 1..``rounds`` rounds; none."""
    optuna = optuna_module()
    if kind == "median":
        return optuna.pruners.MedianPruner()
    if kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=max(rounds, 1))
    return optuna.pruners.NopPruner()


def sampler_seed(run_seed: int, trials_so_far: int) -> int:
    """The sampler's seed: the run seed for a new study, so a tune is reproducible; a resumed study's also depends on
    how many trials it holds, so its random draws do not repeat the first start's."""
    if trials_so_far == 0:
        return run_seed
    return int(np.random.SeedSequence([run_seed, trials_so_far]).generate_state(1)[0])


# ---------------------------------------------------------------------------------------------- the study
def study_record(base: Config, space: SearchSpace, settings: TuneSettings, seeds: list[int]) -> dict[str, Any]:
    """What a study is made for, stored in its user attributes and compared when a tune resumes it."""
    from fedhet.engine.training import resolve_config

    return {
        "config": resolve_config(base),
        "space": space.describe(),
        "metric": settings.metric,
        "reduce": settings.reduce,
        "seeds": list(seeds),
    }


def check_record(saved: Any, now: dict[str, Any], db: Path) -> None:
    """Refuse a study made for another config, space or objective, naming every setting that differs."""
    from fedhet.engine.training import config_changes

    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise ConfigError(f"{db} holds a study fedhet did not make (no 'fedhet' user attribute); tune elsewhere")
    changes = config_changes(saved["config"], now["config"])
    rounds = saved["config"].get("run", {}).get("rounds"), now["config"]["run"]["rounds"]
    if rounds[0] != rounds[1]:  # a resumable change for a run, not for a tune: its trials' objectives would differ
        changes.append(f"run.rounds: {rounds[0]!r} -> {rounds[1]!r}")
    keys = ("space", "metric", "reduce", "seeds")
    changes += [f"{k}: {saved.get(k, [])!r} -> {now[k]!r}" for k in keys if saved.get(k, []) != now[k]]
    if changes:
        raise ConfigError(
            f"{db} was made for another tune: {'; '.join(changes)}; give the settings it was made with, or tune into "
            "another folder (--name, --out)"
        )


def open_study(
    out_dir: Path, base: Config, space: SearchSpace, settings: TuneSettings, parallel: bool, seeds: list[int] = ()
) -> Any:
    """The folder's study, created (with its record) or loaded (and checked against this tune's settings)."""
    optuna = optuna_module()
    store = storage(out_dir)
    record = study_record(base, space, settings, list(seeds))
    names = optuna.study.get_all_study_names(store)
    if names:
        study = optuna.load_study(study_name=names[0], storage=store)
        check_record(study.user_attrs.get("fedhet"), record, out_dir / STUDY_FILE)
    else:
        study = optuna.create_study(study_name=out_dir.name, storage=store, direction=settings.direction)
        study.set_user_attr("fedhet", record)
    trials_so_far = len(study.get_trials(deepcopy=False))
    study.sampler = make_sampler(settings.sampler, space, sampler_seed(base.run.seed, trials_so_far), parallel)
    study.pruner = make_pruner(settings.pruner, base.run.rounds)
    return study


def requeue_interrupted(study: Any) -> list[int]:
    """Trials left RUNNING by a killed tune: enqueued again with their parameters (``continues``: the old number),
    then marked FAIL. Returns their numbers. Only called while this process holds the tune folder's lock."""
    optuna = optuna_module()
    state = optuna.trial.TrialState
    trials = study.get_trials(deepcopy=False)
    succeeded = {t.user_attrs.get("continues") for t in trials}
    stale = [t for t in trials if t.state == state.RUNNING]
    for t in stale:
        if t.number not in succeeded:  # enqueued before a kill that came before the FAIL below: not twice
            study.enqueue_trial(t.params, user_attrs={"continues": t.number, **_carried(t)})
        study.tell(t.number, state=state.FAIL)
    return [t.number for t in stale]


def _carried(trial: Any) -> dict[str, Any]:
    """The folder a continued trial takes over (a trial that continued another keeps that one's chain)."""
    return {"continued_from": trial.user_attrs.get("continued_from", []) + [trial.number]}


def counted(study: Any) -> list[Any]:
    """The trials that count towards ``--trials``: finished (COMPLETE, PRUNED), or failed on their own (a FAIL with
    no successor, i.e. not a trial that a killed tune left running)."""
    optuna = optuna_module()
    state = optuna.trial.TrialState
    trials = study.get_trials(deepcopy=False)
    succeeded = {t.user_attrs.get("continues") for t in trials}
    return [
        t
        for t in trials
        if t.state in (state.COMPLETE, state.PRUNED) or (t.state == state.FAIL and t.number not in succeeded)
    ]


def best_trial(study: Any) -> Any | None:
    """The best COMPLETE trial, or None when none completed."""
    optuna = optuna_module()
    done = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.COMPLETE]
    return study.best_trial if done else None
