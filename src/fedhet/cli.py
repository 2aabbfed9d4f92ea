"""The ``fedhet`` command line: run, compare, tune, demo, partition, report, list, cache, flower."""

from __future__ import annotations

import os
import sys
import warnings
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, NoReturn

import click
import typer
from rich.markup import escape
from rich.table import Table

from fedhet import api
from fedhet.cli_cache import cache_app
from fedhet.cli_shared import (
    ANY_COMMAND,
    BUILDING_CONFIG,
    SUGGEST_COMMANDS,
    AcceptPluginsOpt,
    AlgorithmOpt,
    ClientsOpt,
    Commands,
    ConfigOpt,
    DataDirOpt,
    DatasetOpt,
    ModelOpt,
    NameOpt,
    OutOpt,
    PartitionOpt,
    PluginOpt,
    RoundsOpt,
    SeedOpt,
    ServerOpt,
    SetOpt,
    ThreadsOpt,
    check_shortcut_conflicts,
    console,
    err_console,
    interrupted,
    print_final,
    set_threads,
    shortcuts,
    usage_error_line,
)
from fedhet.engine.display import print_warning
from fedhet.errors import ConfigError, FedhetError, FedhetWarning, Interrupted, RunFailed
from fedhet.flower.cli import flower_app

app = typer.Typer(
    cls=Commands,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Federated learning on non-IID data: run, compare and report FL algorithms.",
    **SUGGEST_COMMANDS,
)
app.add_typer(flower_app, name="flower")  # fedhet flower app | simulate | export (fedhet.flower.cli)
app.add_typer(cache_app, name="cache")  # fedhet cache list | clean: Hugging Face datasets' prepared arrays


# compare's options that `fedhet demo` passes through to it
VariantsOpt = Annotated[
    str | None,
    typer.Option(
        "--variants", "-v", help="Comma list of ALGORITHM[+SERVER_OPTIMISER], e.g. fedavg,fedprox,fedavg+fedadam."
    ),
]
SeedsOpt = Annotated[str | None, typer.Option("--seeds", help="Comma list of seeds, e.g. 0,1,2.")]
BaselineOpt = Annotated[
    str | None,
    typer.Option(
        "--baseline",
        help="The method every row is compared with, in its own setting (paired by seed: difference, bootstrap 95% "
        "interval, Wilcoxon p), e.g. fedavg or 'fedprox mu=0.1'; 'none' for no comparison. Default: fedavg where "
        "the runs have it and some row shares two seeds with it.",
    ),
]
JobsOpt = Annotated[
    str, typer.Option("--jobs", "-j", help="Cells run at once, in worker processes; 0 or auto: one per core.")
]
CellThreadsOpt = Annotated[
    int | None,
    typer.Option("--threads", min=1, help="Torch threads per cell (default: usable cores / jobs, at least 1)."),
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="List the cells and what each would do (start, skip, resume); train none.")
]
RerunOpt = Annotated[bool, typer.Option("--overwrite", help="Rerun every cell from scratch.")]
# tune's (and compare --tune's) search space
SpaceOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--tune-param",
        "-t",
        help="Add a dimension to the search space (repeat): -t train.lr (its declared range), "
        "-t algorithm.mu=log:1e-3:1, "
        "int:1:5, uniform:0:1, choice:a,b. The algorithm's own tunable parameters are in by default.",
    ),
]


def _print_version(value: bool) -> None:
    if value:
        from fedhet.plugins import fedhet_version

        info = fedhet_version()
        commit = f" (git {info['commit'][:12]}{', modified' if info.get('dirty') else ''})" if "commit" in info else ""
        console.print(f"fedhet {info['version']}{commit}", highlight=False)
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print fedhet's version (and git commit), exit."
        ),
    ] = False,
) -> None:
    """Federated learning on non-IID data: run, compare and report FL algorithms."""


@app.command()
def run(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    algorithm: AlgorithmOpt = None,
    dataset: DatasetOpt = None,
    partition: PartitionOpt = None,
    model: ModelOpt = None,
    server: ServerOpt = None,
    rounds: RoundsOpt = None,
    clients: ClientsOpt = None,
    seed: SeedOpt = None,
    out: OutOpt = None,
    name: NameOpt = None,
    data_dir: DataDirOpt = None,
    plugin: PluginOpt = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the run's last checkpoint.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing run folder.")] = False,
    threads: ThreadsOpt = None,
    accept_changed_plugins: AcceptPluginsOpt = False,
) -> None:
    """Train one algorithm on one federated setting; writes a run folder (config, metrics, checkpoints)."""
    from fedhet.engine.rundir import check_run_flags
    from fedhet.naming import check_config_paths
    from fedhet.plugins import accept_changes

    check_run_flags(resume, overwrite)
    accept_changes(accept_changed_plugins)
    set_threads(threads)
    with interrupted(BUILDING_CONFIG):
        cfg = api.make_config(config, set_, plugins=plugin or (), **shortcuts(locals()))
        check_config_paths(cfg, writable=True)  # the output folders can be made and written, before any data loads
    run_dir = api.run_dir_of(cfg)
    with interrupted(f"the last checkpoint is kept; continue with --resume or: fedhet resume {run_dir}"):
        result = api.run(cfg, resume=resume, overwrite=overwrite, console=err_console)
    print_final(result.summary, result.run_dir)


@app.command()
def resume(
    run_dir: Annotated[
        Path, typer.Argument(readable=False, help="The run folder to continue (it may have been moved or copied).")
    ],
    rounds: Annotated[int | None, typer.Option("--rounds", "-r", help="Train to this round (extends a run).")] = None,
    set_: SetOpt = None,
    plugin: Annotated[
        list[str] | None,
        typer.Option("--plugin", help="Replace the run's plug-ins (run.plugins), e.g. where their files moved."),
    ] = None,
    threads: ThreadsOpt = None,
    accept_changed_plugins: AcceptPluginsOpt = False,
) -> None:
    """Continue a killed run (or extend a finished one) from its folder alone, with the config saved in it."""
    from fedhet.plugins import accept_changes

    accept_changes(accept_changed_plugins)
    set_threads(threads)
    with interrupted(f"the last checkpoint is kept; continue with: fedhet resume {run_dir}"):
        result = api.resume(run_dir, rounds, set_ or (), plugins=plugin, console=err_console)
    print_final(result.summary, result.run_dir)


@app.command()
def compare(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    variants: VariantsOpt = None,
    seeds: SeedsOpt = None,
    baseline: BaselineOpt = None,
    partitions: Annotated[
        str | None,
        typer.Option(
            "--partitions",
            help="per-seed: each seed draws its own partition (mean ± std includes partition variance); fixed: every "
            "seed trains on one partition (partition.seed, else the first seed). Default: compare.partitions, else "
            "fixed only when the config sets partition.seed. The table says which.",
        ),
    ] = None,
    grid: Annotated[
        list[str] | None,
        typer.Option(
            "--grid",
            "-g",
            help="Sweep a setting: -g partition.alpha=0.1,0.5 (repeat for every combination; a list value in "
            "brackets: -g model.hidden=[32],[64,64]). Each point gets a folder named by its values (alpha0.1).",
        ),
    ] = None,
    algorithm: Annotated[str | None, typer.Option("--algorithm", "-a", help="One variant (as --variants X).")] = None,
    dataset: DatasetOpt = None,
    partition: PartitionOpt = None,
    model: ModelOpt = None,
    server: ServerOpt = None,
    rounds: RoundsOpt = None,
    clients: ClientsOpt = None,
    seed: Annotated[int | None, typer.Option("--seed", help="One seed (as --seeds N).")] = None,
    out: OutOpt = None,
    name: Annotated[
        str | None, typer.Option("--name", help="The comparison's folder, under --out (run.out_dir).")
    ] = None,
    data_dir: DataDirOpt = None,
    plugin: PluginOpt = None,
    jobs: JobsOpt = "1",
    threads: CellThreadsOpt = None,
    dry_run: DryRunOpt = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Accepted for old scripts: compare always continues unfinished cells.")
    ] = False,
    overwrite: RerunOpt = False,
    tune: Annotated[
        int | None,
        typer.Option(
            "--tune",
            help="Tune every variant first with this many trials each (equal budget), on validation data and the "
            "tuning seed; the final runs use each variant's best values.",
        ),
    ] = None,
    tune_rounds: Annotated[
        int | None, typer.Option("--tune-rounds", help="Rounds of a tuning run (default: the final runs').")
    ] = None,
    tune_seeds: Annotated[
        str | None,
        typer.Option(
            "--tune-seeds",
            help="Tuning seed(s), e.g. 100,101: a trial's objective is their mean (default 100; none of --seeds).",
        ),
    ] = None,
    space: SpaceOpt = None,
    metric: Annotated[
        str, typer.Option("--metric", help="With --tune: the validation metric to optimise (val_acc, val_loss...).")
    ] = "val_acc",
    reduce: Annotated[
        str,
        typer.Option(
            "--reduce", help="With --tune: a run's objective is its 'last' value, its 'best', or 'last3' (mean of 3)."
        ),
    ] = "last",
    sampler: Annotated[str, typer.Option("--sampler", help="With --tune: tpe, random or grid.")] = "tpe",
    pruner: Annotated[str, typer.Option("--pruner", help="With --tune: median, hyperband or none.")] = "median",
    accept_changed_plugins: AcceptPluginsOpt = False,
) -> None:
    """Run several algorithms (x seeds x grid values) on the same setting; print a table and write an accuracy plot.

    Rerunning the same command skips finished cells and continues killed ones from their last checkpoint."""
    from fedhet.cells import parse_jobs
    from fedhet.engine.rundir import check_run_flags
    from fedhet.plugins import accept_changes

    check_run_flags(resume, overwrite)
    accept_changes(accept_changed_plugins)
    with interrupted(
        "every cell keeps its last checkpoint; run the same command again to continue (finished cells are "
        "skipped, the others resume)"
    ):
        api.compare(
            config,
            set_,
            variants=variants,
            seeds=seeds,
            grid=grid,
            partitions=partitions,
            baseline=baseline,
            jobs=parse_jobs(jobs),
            threads=threads,
            overwrite=overwrite,
            dry_run=dry_run,
            **_tune_options(locals()),
            plugins=plugin or (),
            console=console,
            err_console=err_console,
            **shortcuts(locals(), unchecked=("name",)),
        )


def _tune_options(values: dict[str, Any]) -> dict[str, Any]:
    """compare's tuning options as ``api.compare`` takes them; any of them without --tune is refused."""
    given = {
        "--tune-rounds": values["tune_rounds"] is not None,
        "--tune-seeds": values["tune_seeds"] is not None,
        "-t": bool(values["space"]),
        "--metric": values["metric"] != "val_acc",
        "--reduce": values["reduce"] != "last",
        "--sampler": values["sampler"] != "tpe",
        "--pruner": values["pruner"] != "median",
    }
    if values["tune"] is None:
        used = [flag for flag, on in given.items() if on]
        if used:
            raise ConfigError(f"{', '.join(used)} set(s) how compare tunes: add --tune TRIALS")
        return {}
    return {
        "tune": values["tune"],
        "tune_rounds": values["tune_rounds"],
        "tune_seeds": values["tune_seeds"],
        "tune_space": values["space"] or [],
        "tune_metric": values["metric"],
        "tune_reduce": values["reduce"],
        "tune_sampler": values["sampler"],
        "tune_pruner": values["pruner"],
    }


@app.command()
def tune(
    trials: Annotated[int, typer.Option("--trials", help="Trials in all (a resumed tune runs the missing ones).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    space: SpaceOpt = None,
    metric: Annotated[
        str,
        typer.Option(
            "--metric",
            help="The validation metric to optimise: val_acc, val_loss, val_client_acc_*, val_personal_acc_*.",
        ),
    ] = "val_acc",
    reduce: Annotated[
        str,
        typer.Option(
            "--reduce",
            help="A run's objective: its metric at the 'last' evaluation, its 'best', or 'last3' (mean of the last 3).",
        ),
    ] = "last",
    sampler: Annotated[
        str, typer.Option("--sampler", help="tpe (seeded from run.seed), random, or grid (3 points per float range).")
    ] = "tpe",
    pruner: Annotated[
        str,
        typer.Option("--pruner", help="Stop poor trials early on the round-wise metric: median, hyperband, none."),
    ] = "median",
    seeds: Annotated[
        str | None,
        typer.Option(
            "--seeds",
            help="Tuning seeds, e.g. 100,101: each trial runs once per seed, scored by their mean (default: --seed).",
        ),
    ] = None,
    algorithm: AlgorithmOpt = None,
    dataset: DatasetOpt = None,
    partition: PartitionOpt = None,
    model: ModelOpt = None,
    server: ServerOpt = None,
    rounds: RoundsOpt = None,
    clients: ClientsOpt = None,
    seed: SeedOpt = None,
    out: OutOpt = None,
    name: Annotated[
        str | None, typer.Option("--name", help="The tune's folder, under --out (default tune-<the run's name>).")
    ] = None,
    data_dir: DataDirOpt = None,
    plugin: PluginOpt = None,
    jobs: Annotated[
        str, typer.Option("--jobs", "-j", help="Trials at once, in worker processes; 0 or auto: one per core.")
    ] = "1",
    threads: CellThreadsOpt = None,
    accept_changed_plugins: AcceptPluginsOpt = False,
) -> None:
    """Tune a run's hyper-parameters on validation data (Optuna): a study in OUT/study.db, a run folder per trial.

    Needs -s partition.validation_fraction=0.1 (or another fraction). Running the same command again continues a
    killed tune: finished trials are kept, the ones it was running are rerun."""
    from fedhet.cells import parse_jobs
    from fedhet.tuning.tuner import print_result

    with interrupted(
        "the study keeps every finished trial; run the same command again to continue (the trials that were "
        "running are rerun from their checkpoints)"
    ):
        result = api.tune(
            config,
            set_,
            space=space or [],
            trials=trials,
            metric=metric,
            reduce=reduce,
            sampler=sampler,
            pruner=pruner,
            seeds=seeds,
            jobs=parse_jobs(jobs),
            threads=threads,
            plugins=plugin or (),
            console=err_console,
            accept_changed_plugins=accept_changed_plugins,
            **shortcuts(locals()),
        )
    print_result(result, console)


@app.command()
def demo(
    set_: SetOpt = None,
    variants: VariantsOpt = None,
    seeds: SeedsOpt = None,
    rounds: RoundsOpt = None,
    out: Annotated[
        str | None, typer.Option("--out", "-o", help="Parent folder of the runs (run.out_dir; default demo-runs).")
    ] = None,
    data_dir: DataDirOpt = None,
    jobs: JobsOpt = "1",
    threads: CellThreadsOpt = None,
    dry_run: DryRunOpt = False,
    overwrite: RerunOpt = False,
    print_config: Annotated[
        bool, typer.Option("--print-config", help="Print the demo's config (TOML) and exit, e.g. > demo.toml.")
    ] = False,
) -> None:
    """The README's demo: every implemented algorithm for 20 rounds on Fashion-MNIST, Dirichlet(0.1) over 20 clients.

    fedhet compare with the config installed with fedhet: a table, demo-runs/comparison.md and comparison.png.

    Smaller: -v fedavg,scaffold -r 5 (-s dataset.name=digits needs no data files). Run again: continues."""
    config = resources.files("fedhet") / "configs" / "demo.toml"
    if print_config:
        sys.stdout.write(config.read_text(encoding="utf-8"))
        return
    with resources.as_file(config) as path:
        compare(
            config=path,
            set_=set_,
            variants=variants,
            seeds=seeds,
            rounds=rounds,
            out=out,
            data_dir=data_dir,
            jobs=jobs,
            threads=threads,
            dry_run=dry_run,
            overwrite=overwrite,
        )


@app.command("partition")
def partition_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    dataset: DatasetOpt = None,
    partition: PartitionOpt = None,
    clients: ClientsOpt = None,
    seed: SeedOpt = None,
    data_dir: DataDirOpt = None,
    plugin: PluginOpt = None,
    plot: Annotated[
        Path, typer.Option("--plot", readable=False, help="Where to write the label-distribution plot.")
    ] = Path("partition.png"),
    save: Annotated[
        Path | None,
        typer.Option(
            "--save",
            readable=False,
            help="Also write the clients' index sets to this JSON file; a run uses it with -p file -s "
            "partition.path=FILE (docs/non-iid.md).",
        ),
    ] = None,
) -> None:
    """Show how a dataset is split across clients: sizes, label counts, and a label-distribution plot."""
    from fedhet.engine.training import build_federation, load_data, partition_of, to_save
    from fedhet.paths import check_output_file
    from fedhet.results.plots import plot_label_distribution

    check_output_file(plot, "--plot")
    if save is not None:
        check_output_file(save, "--save")
    given = {"dataset": dataset, "partition": partition, "clients": clients, "seed": seed, "data_dir": data_dir}
    check_shortcut_conflicts(set_ or (), given)
    with interrupted(BUILDING_CONFIG):
        cfg = api.make_config(config, set_, plugins=plugin or (), **given)
    with interrupted("while the clients' data was being split; run the command again"):
        ds = load_data(cfg)
        split = partition_of(cfg, ds)
        fed = build_federation(cfg, ds, split)
    counts = fed.train_counts
    names = class_names(ds, fed.num_classes)
    table = Table(title=f"{cfg.dataset.name} / {cfg.partition.name} {cfg.partition.params() or ''}")
    table.add_column("client", justify="right")
    table.add_column("size", justify="right")
    table.add_column("classes", justify="right")
    for name in names:
        table.add_column(escape(name), justify="right")
    for i, row in enumerate(counts):
        table.add_row(str(i), str(int(row.sum())), str(int((row > 0).sum())), *[str(int(v)) for v in row])
    console.print(table)
    sizes = counts.sum(1)
    console.print(
        f"clients={len(sizes)} samples={int(sizes.sum())} size min/median/max="
        f"{int(sizes.min())}/{int(sorted(sizes)[len(sizes) // 2])}/{int(sizes.max())} "
        f"global test set: {len(fed.y_test)} ({fed.test_source})"
    )
    title = f"{cfg.dataset.name}: {cfg.partition.name} label split"
    path = plot_label_distribution(counts, plot, title=title, class_names=names)
    console.print(f"plot: {path}")
    if save is not None:
        console.print(f"partition: {to_save(cfg, split).save(save)}")


def class_names(ds, num_classes: int) -> list[str]:
    """The dataset's class names where it has one per class, else the class numbers."""
    names = ds.class_names
    if names and len(names) == num_classes:
        return [str(name) for name in names]
    return [str(c) for c in range(num_classes)]


@app.command()
def report(
    runs: Annotated[
        list[Path], typer.Argument(readable=False, help="Run folders, or folders that contain run folders.")
    ],
    metric: Annotated[str, typer.Option("--metric", help="Metric to tabulate and plot.")] = "test_acc",
    plot: Annotated[
        Path | None, typer.Option("--plot", readable=False, help="Write the curve plot here (PNG).")
    ] = None,
    markdown: Annotated[
        Path | None, typer.Option("--markdown", readable=False, help="Also write the table as Markdown.")
    ] = None,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html", readable=False, help="Also write one self-contained HTML page: tables, curves, each run's config."
        ),
    ] = None,
    smooth: Annotated[
        bool, typer.Option("--smooth", help="Plot the EMA the runs recorded (test_acc_ema; run.ema for others).")
    ] = False,
    panels: Annotated[
        str | None, typer.Option("--panels", help="One plot panel per method 'family' or per 'setting'.")
    ] = None,
    x: Annotated[
        str,
        typer.Option(
            "--x", help="The plots' x axis: 'round', or 'sim/time' (simulated seconds, with a \\[system] section)."
        ),
    ] = "round",
    baseline: BaselineOpt = None,
) -> None:
    """Summarise finished (or running) runs: a mean ± std table over seeds with 95% intervals, each row's paired
    difference from a baseline method, average ranks over settings, and accuracy-vs-round curves."""
    from fedhet.engine.display import print_warning
    from fedhet.paths import check_folder, check_output_file
    from fedhet.results.html import write_html
    from fedhet.results.plots import PANELS, X_LABELS, plot_curves
    from fedhet.results.report import (
        AUTO,
        check_metric,
        group_runs,
        load_runs,
        print_report,
        report_markdown,
        summary_table,
        table_notes,
    )

    if panels not in (None, *PANELS):
        raise ConfigError(f"unknown --panels {panels!r}; choose one of: {', '.join(PANELS)}")
    if x not in X_LABELS:
        raise ConfigError(f"unknown --x {x!r}; choose one of: {', '.join(X_LABELS)}")
    for folder in runs:
        check_folder(folder, "run folder (RUNS)", must_exist=True)
    # every output before anything is read or written: a bad --html must not leave a lone Markdown file behind
    outputs = {"--markdown": markdown, "--plot": plot, "--html": html}
    for option, path in outputs.items():
        if path is not None:
            check_output_file(path, option)
    chosen = [p for p in outputs.values() if p is not None]
    if len({os.path.abspath(p) for p in chosen}) < len(chosen):
        raise ConfigError("--markdown, --plot and --html must name different files")
    loaded = load_runs(runs, lambda text: print_warning(err_console, text))  # a torn line: one warning: line
    if not loaded:
        raise ConfigError(f"no run folders (with config.json and metrics.jsonl) under {', '.join(map(str, runs))}")
    check_metric(loaded, metric)
    groups = group_runs(loaded)
    rows = summary_table(groups, metric=metric, baseline=baseline or AUTO)
    notes = table_notes(groups, rows)
    print_report(rows, console, notes)
    if markdown:
        markdown.write_text(report_markdown(rows, notes))
        console.print(f"markdown: {markdown}")
    if plot:
        console.print(f"plot: {plot_curves(groups, plot, metric=metric, smooth=smooth, panels=panels, x=x)}")
    if html:
        page = write_html(groups, html, metrics=(metric,), smooth=smooth, panels=panels, x=x, baseline=baseline or AUTO)
        console.print(f"html: {page}")


# what `fedhet list` takes: each kind in the plural, its singular, and the config section that names it
LIST_ALIASES = {
    "dataset": "datasets",
    "partitioner": "partitioners",
    "partition": "partitioners",
    "feature": "features",
    "feature_skew": "features",
    "feature_skews": "features",
    "model": "models",
    "algorithm": "algorithms",
    "server": "servers",
    "server_optimizer": "servers",
    "server_optimiser": "servers",
}


@app.command("list")
def list_cmd(
    what: Annotated[
        str | None,
        typer.Argument(
            help="datasets | partitioners | features | models | algorithms | servers (singular too) | config (every "
            "setting)"
        ),
    ] = None,
    plugin: PluginOpt = None,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="With 'config': print the reference as Markdown (docs/config.md).")
    ] = False,
) -> None:
    """List what fedhet offers (and the plug-ins provide), with one-line descriptions and each parameter's default;
    `fedhet list config` lists every config key."""
    from fedhet import plugins
    from fedhet.algorithms import ALGORITHMS, SERVER_OPTIMIZERS
    from fedhet.data.datasets import DATASETS
    from fedhet.data.features import FEATURE_SKEWS
    from fedhet.data.partition import PARTITIONERS
    from fedhet.errors import unknown_choice
    from fedhet.models import MODELS

    kinds = {
        "datasets": DATASETS,
        "partitioners": PARTITIONERS,
        "features": FEATURE_SKEWS,
        "models": MODELS,
        "algorithms": ALGORITHMS,
        "servers": SERVER_OPTIMIZERS,
    }
    if what is not None:
        what = what.strip().lower()
        what = LIST_ALIASES.get(what, what)
        if what not in (*kinds, "config"):
            raise unknown_choice("list", what, [*kinds, "config"])
    if markdown and what != "config":
        raise ConfigError("--markdown goes with 'fedhet list config' (the reference of every config key)")
    try:
        specs = [plugins.normalise(spec) for spec in plugin or ()]
    except ValueError as err:
        raise ConfigError(f"--plugin: {err}") from None
    plugins.load(specs)
    if what == "config":
        from fedhet.reference import config_markdown, config_rows

        if markdown:
            print(config_markdown(), end="")
            return
        table = Table(title="config keys", show_lines=False, title_justify="left")
        for column in ("key", "type", "default", "description"):
            table.add_column(column, style="bold" if column == "key" else None)
        for row in config_rows():
            table.add_row(*(escape(str(v)) for v in row))
        console.print(table)
        return
    for kind, registry in kinds.items():
        if what not in (None, kind):
            continue
        table = Table(title=kind, show_lines=False, title_justify="left")
        table.add_column("name", style="bold")
        table.add_column("description")
        table.add_column("parameters (defaults)")
        # which models take which datasets' inputs (models/fit.py), and the model a dataset gets by default
        extra = {"models": "fits datasets", "datasets": "default model"}.get(kind)
        if extra:
            table.add_column(extra)
        tuned = kind in ("algorithms", "servers")  # the search space each declares (docs/tuning.md)
        if tuned:
            table.add_column("tunable (default range)" if kind == "algorithms" else "tunable, opt-in (default range)")
            table.caption = _tuning_caption(kind)
        for e in registry.entries():
            params = ""
            if e.params is not None:
                fields = e.params.model_fields.items()
                params = ", ".join(
                    f"{k} (required)" if f.is_required() else f"{k}={f.get_default(call_default_factory=True)!r}"
                    for k, f in fields
                )
            cells = [_fit_text(kind, e.name)] if extra else []
            if tuned:
                space = e.params.tunable if e.params is not None else {}
                cells.append(", ".join(f"{k}={v}" for k, v in space.items()) or "(none)")
            table.add_row(*map(escape, (e.name, e.summary, params, *cells)))  # as written: "fedhet[hf]" is no style tag
        console.print(table)


def _tuning_caption(kind: str) -> str:
    """What the tunable column means: an algorithm's ranges are its default search space; the shared ones join
    only when named (-t train.lr)."""
    from fedhet.config import TrainSection

    if kind == "servers":
        return "server.<p> joins a search space only when named: -t server.lr (docs/tuning.md)"
    shared = ", ".join(f"train.{k}={v}" for k, v in TrainSection.tunable.items())
    return f"an algorithm's tunable parameters are its default search space; opt-in with -t: {shared} (docs/tuning.md)"


def _fit_text(kind: str, name: str) -> str:
    """``fedhet list``'s fit column: the datasets a model takes, or the model a dataset gets without model.name."""
    from fedhet.models import fit

    if kind == "models":
        return ", ".join(fit.fits(name)) or "(none built in)"
    if name in fit.BY_TASK:
        return ", ".join(f"{model} (dataset.task={task})" for task, model in fit.BY_TASK[name].items())
    if fit.dataset_input(name) is None:
        return f"{fit.DEFAULT_MODEL} (input not known before loading)"
    return fit.default_model(name)


# click >= 8.2 raises this usage error after `fedhet` alone printed the help; older click exits by itself
NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def one_line_warnings(default):
    """``warnings.showwarning`` that prints fedhet's own warnings as one ``warning:`` line (no file, no source line)
    and leaves the others to ``default``."""

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, FedhetWarning):
            print_warning(err_console, str(message))
        else:
            default(message, category, filename, lineno, file, line)

    return show


def main() -> None:
    try:
        with warnings.catch_warnings():  # restores showwarning when the command ends
            warnings.showwarning = one_line_warnings(warnings.showwarning)
            # not standalone: click's usage errors come here, to be printed as one line like fedhet's own
            code = app(prog_name="fedhet", standalone_mode=False)
    except NO_ARGS_IS_HELP:  # `fedhet` alone: typer has printed the help
        sys.exit(2)
    except click.ClickException as err:
        err_console.print(usage_error_line(err), soft_wrap=True, highlight=False)
        sys.exit(err.exit_code)
    except Interrupted as err:
        _exit_interrupted(str(err))
    except RunFailed as err:  # the run started and could not go on: exit 1, as a failed program does
        err_console.print(f"[red]failed:[/] {escape(str(err))}", soft_wrap=True, highlight=False)
        sys.exit(1)
    except FedhetError as err:
        # One line however long (no wrapping at the console width), and brackets in the message are not markup.
        err_console.print(f"[red]error:[/] {escape(str(err))}", soft_wrap=True, highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:  # while a line above was printed
        _exit_interrupted(ANY_COMMAND)
    if code == 130:  # typer's silent exit for a Ctrl-C before any command ran (its arguments being read)
        _exit_interrupted(ANY_COMMAND)
    sys.exit(code or 0)  # --help, --version: 0


def _exit_interrupted(how_to_continue: str) -> NoReturn:
    err_console.print(f"[yellow]interrupted[/]: {escape(how_to_continue)}", soft_wrap=True, highlight=False)
    raysim = sys.modules.get("fedhet.flower.raysim")
    if raysim is not None and raysim.abandoned():
        # Flower's worker threads wait forever on Ray, which Ctrl-C shut down under them, and Python's exit would
        # wait for them. The run's files are written and closed; end without waiting.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(130)


if __name__ == "__main__":
    main()
