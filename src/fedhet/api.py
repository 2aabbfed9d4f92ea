"""fedhet's Python API: build a config, run it, compare several, read the results. The CLI is a thin layer over it.

    import fedhet

    # demo.toml: the README demo's config, written by `fedhet demo --print-config > demo.toml`
    cfg = fedhet.make_config("demo.toml", {"train.lr": 0.05}, algorithm="scaffold", rounds=5)
    result = fedhet.run(cfg)
    result.final["test_acc"]            # the last evaluation's metrics
    result.records                      # one dict per evaluated round (metrics.jsonl)
    result.to_dataframe()               # the same as a pandas DataFrame (needs pandas)
    results = fedhet.compare(cfg, variants=["fedavg", "fedprox"], seeds=[0, 1])
    tuned = fedhet.tune(cfg, {"partition.validation_fraction": 0.1}, space=["train.lr"], trials=20)
    tuned.best_params                   # {"algorithm.mu": 0.013, "train.lr": 0.041}, chosen on validation data
    rows = fedhet.report(results)       # mean ± std over seeds, one row per setting
    fedhet.save_partition(cfg, "clients.json")  # the clients' index sets; a run uses partition.name = "file"

Every function takes a config as a ``Config``, a dict (``{"train": {"lr": 0.05}}``, sections as in the TOML
files), or the path of a TOML file; ``plugins=`` names plug-in files or modules (fedhet/plugins.py) that register
components from outside fedhet. Errors are ``fedhet.errors.ConfigError`` (a wrong setting, worded as on the
command line) and ``RunFailed`` (a run that could not go on).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedhet.config import Config, apply_override, build_config, load_raw, plugins_from_file, set_dotted
from fedhet.errors import ConfigError

if TYPE_CHECKING:
    import pandas
    from rich.console import Console

    from fedhet.data.partition_file import SavedPartition
    from fedhet.results.report import Row
    from fedhet.tuning.tuner import TuneResult

ConfigSource = Config | Mapping[str, Any] | str | Path | None

# keyword shortcut -> the setting it sets; the CLI's -a -d -p -m -n -r -o --name --seed --server --data-dir
SHORTCUTS: dict[str, str] = {
    "algorithm": "algorithm.name",
    "dataset": "dataset.name",
    "partition": "partition.name",
    "model": "model.name",
    "server": "server.name",
    "clients": "partition.num_clients",
    "rounds": "run.rounds",
    "out": "run.out_dir",
    "name": "run.name",
    "seed": "run.seed",
    "data_dir": "dataset.data_dir",
}


def config_dict(
    source: ConfigSource = None,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    plugins: Iterable[str | Path] = (),
    **shortcuts: Any,
) -> dict[str, Any]:
    """The raw (unvalidated) config: ``source``, then the shortcuts, then ``overrides`` (dotted keys, which win),
    then the plug-ins added to ``run.plugins``. A TOML file's ``[compare]`` table is kept."""
    raw = _source_raw(source)
    for key, value in shortcuts.items():
        if key not in SHORTCUTS:
            raise ConfigError(f"unknown shortcut {key!r}; valid: {', '.join(SHORTCUTS)}")
        if value is not None:
            set_dotted(raw, SHORTCUTS[key], value)
    if isinstance(overrides, Mapping):
        for key, value in overrides.items():
            set_dotted(raw, key, value)
    elif isinstance(overrides, str):
        raise ConfigError(f"overrides must be a dict or a list of 'section.key=value' strings, not {overrides!r}")
    else:
        for item in overrides or []:
            apply_override(raw, item)
    extra = [str(p) for p in plugins]
    if extra:
        run = raw.setdefault("run", {})
        if isinstance(run, dict):  # anything else is refused by validation
            run["plugins"] = [*run.get("plugins", []), *extra]
    return raw


def _source_raw(source: ConfigSource) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Config):
        return source.to_dict()
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    if isinstance(source, str | Path):
        return plugins_from_file(load_raw(source), source)
    raise ConfigError(f"a config is a Config, a dict or a TOML file's path, not {type(source).__name__}")


def make_config(
    source: ConfigSource = None,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    plugins: Iterable[str | Path] = (),
    runs_here: bool = True,
    **shortcuts: Any,
) -> Config:
    """A validated ``Config`` from a TOML file, a dict or a Config, with overrides and shortcuts applied.

    ``make_config("demo.toml", {"train.lr": 0.05}, algorithm="scaffold", rounds=5, plugins=["my_method.py"])``.
    Component names and parameters are checked too (the plug-ins are loaded for that), so a mistake fails here.
    ``runs_here=False`` is for a config that runs on other machines (its ``run.device`` need not exist here)."""
    from fedhet.engine.simulation import resolve_config
    from fedhet.naming import check_config_paths

    raw = config_dict(source, overrides, plugins=plugins, **shortcuts)
    raw.pop("compare", None)  # a comparison's variant list: a single run uses the base setting
    cfg = build_config(raw, runs_here=runs_here)
    if runs_here:  # its paths as this machine sees them: no FIFO, file or dangling link where a folder belongs
        check_config_paths(cfg)
    resolve_config(cfg)
    return cfg


@dataclass
class RunResult:
    """A run folder's results: the resolved config, one record per evaluated round, and the summary."""

    run_dir: Path
    config: dict[str, Any]
    records: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def final(self) -> dict[str, Any]:
        """The last evaluation's metrics ({} before the first)."""
        return dict(self.records[-1]) if self.records else {}

    def metric(self, name: str) -> list[tuple[int, float]]:
        """(round, value) of every evaluation that recorded ``name`` (``"test_acc"``)."""
        return [(r["round"], r[name]) for r in self.records if r.get(name) is not None]

    def to_dataframe(self) -> pandas.DataFrame:
        """The records as a DataFrame, one row per evaluated round, with the run's name as a column."""
        return records_dataframe([self])


def load_run(run_dir: str | Path) -> RunResult:
    """The results of a run folder (finished, killed or still running)."""
    from fedhet.results.report import load_run as load

    folder = Path(run_dir)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{str(folder)!r} is not a run folder: it has no config.json")
    run = load(folder)
    return RunResult(folder, run.config, run.metrics, run.summary)


def load_runs(paths: str | Path | Iterable[str | Path]) -> list[RunResult]:
    """Every run folder in or under ``paths``."""
    from fedhet.results.report import load_runs as load

    items = [paths] if isinstance(paths, str | Path) else list(paths)
    return [RunResult(r.path, r.config, r.metrics, r.summary) for r in load(items)]


def run(
    config: ConfigSource = None,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    plugins: Iterable[str | Path] = (),
    resume: bool = False,
    overwrite: bool = False,
    console: Console | None = None,
    accept_changed_plugins: bool = False,
    **shortcuts: Any,
) -> RunResult:
    """Train one config; writes its run folder (``run.out_dir/run.name``) and returns its results.

    ``resume`` continues the folder's last checkpoint, ``overwrite`` replaces the folder; without either an existing
    folder is an error. Progress goes to ``console`` (default: stderr; ``run.progress = false`` hides the bar).
    ``accept_changed_plugins`` resumes a run whose plug-in files changed since it recorded them (else refused)."""
    from fedhet.engine.rundir import check_run_flags
    from fedhet.engine.runs import build_simulation

    check_run_flags(resume, overwrite)
    cfg = make_config(config, overrides, plugins=plugins, **shortcuts)
    sim = build_simulation(cfg, console=console)
    with _accepting_plugins(accept_changed_plugins):
        sim.run(resume=resume, overwrite=overwrite)
    return load_run(sim.run_dir)


def save_partition(
    config: ConfigSource,
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    plugins: Iterable[str | Path] = (),
    **shortcuts: Any,
) -> SavedPartition:
    """The clients' index sets of a config (``.train``, ``.test``, ``.dataset`` fingerprint, ``.made_by``), written to
    ``path`` as ``fedhet partition --save`` writes them when a path is given. A run trains on the file with
    ``partition.name = "file"`` and ``partition.path``; ``load_partition`` reads it back (docs/non-iid.md)."""
    from fedhet.engine.training import load_data, partition_of, to_save
    from fedhet.paths import check_output_file

    if path is not None:
        check_output_file(path, "path")
    cfg = make_config(config, overrides, plugins=plugins, **shortcuts)
    saved = to_save(cfg, partition_of(cfg, load_data(cfg)))
    if path is not None:
        saved.save(path)
    return saved


def load_partition(path: str | Path) -> SavedPartition:
    """A partition file (``save_partition``, ``fedhet partition --save``), its structure checked; a run checks its
    indices against the data it splits."""
    from fedhet.data.partition_file import SavedPartition

    return SavedPartition.load(path, setting="path")


def run_dir_of(config: Config) -> Path:
    """The folder a run of ``config`` writes: ``run.out_dir/run.name`` (the name derived when unset)."""
    from fedhet.naming import run_dir

    return run_dir(config)


def resume(
    run_dir: str | Path,
    rounds: int | None = None,
    overrides: Iterable[str] = (),
    *,
    plugins: Iterable[str | Path] | None = None,
    console: Console | None = None,
    accept_changed_plugins: bool = False,
) -> RunResult:
    """Continue a killed run (or extend a finished one to ``rounds``) from its folder alone, with the config and the
    plug-ins saved in it; ``plugins`` replaces those plug-ins (their files moved). A plug-in file edited since the
    run recorded it is refused unless ``accept_changed_plugins``."""
    from fedhet.config import saved_run_config
    from fedhet.engine.runs import build_simulation

    more = [f"run.rounds={rounds}"] if rounds is not None else []
    if plugins is not None:
        more.append(f"run.plugins={[str(p) for p in plugins]!r}")
    sim = build_simulation(saved_run_config(run_dir, [*more, *overrides]), console=console)
    with _accepting_plugins(accept_changed_plugins):
        sim.run(resume=True)
    return load_run(sim.run_dir)


def compare(
    config: ConfigSource = None,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    variants: Sequence[str] | str | None = None,
    seeds: Sequence[int] | str | None = None,
    grid: Mapping[str, Sequence[Any]] | Sequence[str] | None = None,
    partitions: str | None = None,
    baseline: str | None = None,
    jobs: int | str = 1,
    threads: int | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    tune: int | None = None,
    tune_rounds: int | None = None,
    tune_seeds: Sequence[int] | str | int | None = None,
    tune_space: Iterable[str] = (),
    tune_metric: str = "val_acc",
    tune_reduce: str = "last",
    tune_sampler: str = "tpe",
    tune_pruner: str = "median",
    plugins: Iterable[str | Path] = (),
    console: Console | None = None,
    err_console: Console | None = None,
    accept_changed_plugins: bool = False,
    **shortcuts: Any,
) -> list[RunResult]:
    """Run every cell (grid point x seed x variant) of a comparison, as ``fedhet compare`` does; returns the runs.

    ``variants``: ``["fedavg", "fedprox", "fedavg+fedadam"]`` (ALGORITHM[+SERVER_OPTIMISER]); ``seeds``: ``[0, 1]``;
    ``grid``: ``{"partition.alpha": [0.1, 0.5]}``. Unset, they come from the config's ``[compare]`` table. Writes
    comparison.md and comparison.png into ``run.out_dir``; finished cells are skipped, killed ones resumed.
    ``baseline``: the variant every row is compared with, paired by seed ("none"; default fedavg where it is one),
    as ``--baseline``.

    ``jobs``: cells run at once in worker processes (``0`` or ``"auto"``: one per usable core), as ``--jobs``. It
    works from a script without ``if __name__ == "__main__":`` and from a notebook: workers never import
    ``__main__``, and need only the plug-ins named in ``plugins``; a component registered in ``__main__`` is refused
    with ``jobs`` above 1 (put it in a file and pass ``plugins=["my_method.py"]``).

    ``tune=TRIALS`` tunes every variant first, at the same budget, on validation data (``fedhet compare --tune``,
    docs/tuning.md "Tuned comparisons"): ``tune_rounds`` (default: ``run.rounds``), ``tune_seeds`` (one seed,
    default 100, none of ``seeds``), ``tune_space`` (``-t`` specs added to each variant's declared space, where it has
    the key), ``tune_metric``/``tune_reduce``/``tune_sampler``/``tune_pruner`` as ``fedhet.tune`` takes them. The
    final runs use the chosen values; their provenance.json records the study under ``tuning``."""
    from rich.console import Console

    from fedhet.cells import parse_jobs
    from fedhet.comparison import run_comparison
    from fedhet.tuning.compare import TuneOptions

    jobs = parse_jobs(jobs, "jobs")
    tuning = None
    if tune is not None:
        if isinstance(tune_space, str):
            raise ConfigError(f"tune_space must be a list of 'KEY=SPEC' strings, not the string {tune_space!r}")
        seeds_text = tune_seeds if isinstance(tune_seeds, str | int) or tune_seeds is None else list(tune_seeds)
        tuning = TuneOptions(
            tune, tune_rounds, seeds_text, tuple(tune_space), tune_metric, tune_reduce, tune_sampler, tune_pruner
        )
        tuning.settings.check()  # a test metric, 0 trials: refused before anything is built

    variants = _one_or_many(variants, shortcuts.pop("algorithm", None), "variants", "algorithm")
    seeds = _one_or_many(seeds, shortcuts.pop("seed", None), "seeds", "seed")
    folder = shortcuts.pop("name", None)
    raw = config_dict(config, overrides, plugins=plugins, **shortcuts)
    if folder is not None:  # the comparison's own folder under run.out_dir; its cells are named by the comparison
        build_config({"run": {"name": folder}})  # a plain folder name, as run.name must be
        run_section = raw.setdefault("run", {})
        if isinstance(run_section, dict):
            run_section["out_dir"] = str(Path(run_section.get("out_dir", "runs")) / folder)
    variant_text = variants if isinstance(variants, str) or variants is None else ",".join(variants)
    seed_text = seeds if isinstance(seeds, str) or seeds is None else ",".join(str(s) for s in seeds)
    grid_items = None
    if isinstance(grid, Mapping):
        table = raw.setdefault("compare", {})
        if isinstance(table, dict):  # anything else is refused with the [compare] table's own message
            table.setdefault("grid", {}).update({key: list(values) for key, values in grid.items()})
    elif grid is not None:
        grid_items = list(grid)
    quiet = Console(quiet=True)
    with _accepting_plugins(accept_changed_plugins):  # cells whose plug-in changed continue, not refused
        dirs = run_comparison(
            raw,
            [],
            variant_text,
            seed_text,
            grid=grid_items,
            partitions=partitions,
            baseline=baseline,
            jobs=jobs,
            threads=threads,
            overwrite=overwrite,
            dry_run=dry_run,
            tune=tuning,
            console=console or quiet,
            err_console=err_console or console or quiet,
        )
    return [load_run(d) for d in dirs]


def tune(
    config: ConfigSource = None,
    overrides: Mapping[str, Any] | Iterable[str] | None = None,
    *,
    space: Iterable[str] = (),
    trials: int,
    metric: str = "val_acc",
    reduce: str = "last",
    sampler: str = "tpe",
    pruner: str = "median",
    seeds: Sequence[int] | str | int | None = None,
    jobs: int | str = 1,
    threads: int | None = None,
    plugins: Iterable[str | Path] = (),
    console: Console | None = None,
    accept_changed_plugins: bool = False,
    **shortcuts: Any,
) -> TuneResult:
    """Tune a run's hyper-parameters on validation data with Optuna, as ``fedhet tune`` does (docs/tuning.md).

    ``space``: ``-t`` specs added to the algorithm's declared space (``["train.lr", "algorithm.mu=log:1e-3:1"]``);
    ``trials``: the total number of trials (a resumed tune runs the missing ones); ``metric``: a validation metric
    (``val_acc``, ``val_loss``, ...; a test metric is refused); ``reduce``: its ``last`` or ``best`` value over a
    run's evaluations, or ``last3`` (the mean of the last three; any ``last<K>``); ``sampler``: ``tpe`` (seeded
    from ``run.seed``), ``random`` or ``grid``; ``pruner``: ``median``, ``hyperband`` or ``none``; ``jobs``: trials
    at once, in worker processes; ``seeds``: the tuning seeds (``[100, 101]`` or ``"100,101"``), each trial one run
    per seed scored by the mean of their objectives, the first also the sampler's seed and the config's
    ``run.seed`` (default: one run on ``run.seed``). The tune folder is ``run.out_dir/run.name`` (``name=``;
    default ``tune-<the run's name>``): ``study.db``, ``trials/<number>`` (one run folder per trial), ``tune.json``,
    ``tune.md``. Raises ``RunFailed`` when no trial completed."""
    from rich.console import Console

    from fedhet.cells import parse_jobs
    from fedhet.tuning.compare import parse_tune_seeds
    from fedhet.tuning.study import TuneSettings
    from fedhet.tuning.tuner import plan_tune, raise_if_nothing
    from fedhet.tuning.tuner import tune as run_tune

    settings = TuneSettings(trials, metric, reduce, sampler, pruner)
    settings.check()  # a test metric, --trials 0: refused before the config is even built
    jobs = parse_jobs(jobs, "jobs")
    if isinstance(space, str):
        raise ConfigError(f"space must be a list of 'KEY=SPEC' strings, not the string {space!r}")
    seed_list = None
    if seeds is not None:
        seed_list = parse_tune_seeds(seeds if isinstance(seeds, str | int) else list(seeds), "--seeds")
        overridden = config_dict(None, overrides).get("run", {}).get("seed")  # the overrides alone
        given = f"--seed {shortcuts['seed']}" if shortcuts.get("seed") is not None else None
        given = given or (f"-s run.seed={overridden}" if overridden is not None else None)
        if given:
            raise ConfigError(f"{given} and --seeds {seeds!r} both give the tuning seed: give one of them")
        shortcuts["seed"] = seed_list[0]  # the tune folder's name and the sampler's seed follow the first
    cfg = make_config(config, overrides, plugins=plugins, **shortcuts)
    plan = plan_tune(cfg, list(space), settings, seeds=seed_list)
    with _accepting_plugins(accept_changed_plugins):
        result = run_tune(plan, jobs=jobs, threads=threads, console=console or Console(quiet=True))
    raise_if_nothing(result)
    return result


@contextmanager
def _accepting_plugins(accept: bool) -> Iterator[None]:
    """``accept_changed_plugins=True`` as ``--accept-changed-plugins`` for the length of one call (the worker
    processes it starts included); False leaves the setting as it is (the CLI's flag, FEDHET_ACCEPT_CHANGED_PLUGINS)."""
    from fedhet import plugins

    if not accept or plugins.accepting_changes():
        yield
        return
    plugins.accept_changes(True)
    try:
        yield
    finally:
        plugins.accept_changes(False)


def _one_or_many(many: Any, one: Any, many_name: str, one_name: str) -> Any:
    """compare's ``algorithm=`` / ``seed=`` (the CLI's -a, --seed) as a one-element ``variants`` / ``seeds``."""
    if one is None:
        return many
    if many is not None:
        raise ConfigError(f"compare: give {many_name} or {one_name}, not both")
    return [one]


def report(
    runs: RunResult | str | Path | Iterable[RunResult | str | Path], metric: str = "test_acc", baseline: str = "auto"
) -> list[Row]:
    """One row per setting (runs that differ only in seed form one): mean ± std of the final ``metric`` over seeds
    and its 95 % t interval, best, fairness and personalisation columns; with a ``baseline`` method ("auto": fedavg
    where it is there; "none") each row's paired difference from it (``Row.versus``); the table ``fedhet report``
    prints."""
    from fedhet.results.report import check_metric, group_runs, load_runs, summary_table

    items = [runs] if isinstance(runs, RunResult | str | Path) else list(runs)
    paths = [r.run_dir if isinstance(r, RunResult) else Path(r) for r in items]
    if not paths:
        raise ConfigError("report: no runs given")
    loaded = load_runs(paths)
    check_metric(loaded, metric)
    return summary_table(group_runs(loaded), metric=metric, baseline=baseline)


def records_dataframe(results: Iterable[RunResult]) -> pandas.DataFrame:
    """Every record of every run as one DataFrame, one row per evaluated round. Before the metrics, columns that
    say which run a row is from, so a ``groupby`` never merges settings: ``run`` (the folder's name), ``path``
    (the run folder), ``group`` (the row label ``fedhet report`` gives the run's setting), ``algorithm``,
    ``server`` (the server optimiser), ``seed``, and one column per setting that differs between the runs, named
    by its config key (``partition.alpha``: a comparison's grid keys, a variant's parameters). Needs pandas
    (``pip install 'fedhet[pandas]'``)."""
    try:
        import pandas
    except ImportError:
        raise ImportError(
            "to_dataframe needs pandas (pip install 'fedhet[pandas]', or pip install pandas); .records are plain dicts"
        ) from None
    from fedhet.results.report import Run, group_runs, run_settings

    results = list(results)
    settings = [run_settings(r.config) for r in results]
    # the grid keys, and any other setting that tells runs apart (a key some runs lack counts as differing)
    every = dict.fromkeys(k for s in settings for k in s if k not in ("algorithm.name", "server.name"))
    keys = [k for k in every if len({repr(hashable(s.get(k, MISSING_SETTING))) for s in settings}) > 1]
    runs = [Run(r.run_dir, r.config, r.records, r.summary) for r in results]
    label = {id(run): group.label for group in group_runs(runs) for run in group.runs}
    rows = []
    for result, run, flat in zip(results, runs, settings, strict=True):
        head = {
            "run": result.name,
            "path": str(result.run_dir),
            "group": label[id(run)],
            "algorithm": result.config.get("algorithm", {}).get("name"),
            "server": result.config.get("server", {}).get("name"),
            "seed": result.config.get("run", {}).get("seed"),
            **{key: hashable(flat.get(key)) for key in keys},
        }
        rows += [{**head, **record} for record in result.records]
    return pandas.DataFrame(rows)


MISSING_SETTING = object()  # a setting a run's config lacks (a parameter of another variant's algorithm)


def hashable(value: Any) -> Any:
    """A list setting ([32, 64]) as a tuple, so a column of them can be grouped by."""
    return tuple(hashable(v) for v in value) if isinstance(value, list) else value
