"""The ``fedhet`` command line: run, compare, demo, partition, report, list."""

from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path
from typing import Annotated, NoReturn

import click
import typer
from rich.markup import escape
from rich.table import Table

from fedhet import api
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
from fedhet.errors import ConfigError, FedhetError, Interrupted, RunFailed
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


# compare's options that `fedhet demo` passes through to it
VariantsOpt = Annotated[
    str | None,
    typer.Option(
        "--variants", "-v", help="Comma list of ALGORITHM[+SERVER_OPTIMISER], e.g. fedavg,fedprox,fedavg+fedadam."
    ),
]
SeedsOpt = Annotated[str | None, typer.Option("--seeds", help="Comma list of seeds, e.g. 0,1,2.")]
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
            jobs=parse_jobs(jobs),
            threads=threads,
            overwrite=overwrite,
            dry_run=dry_run,
            plugins=plugin or (),
            console=console,
            err_console=err_console,
            **shortcuts(locals(), unchecked=("name",)),
        )


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
) -> None:
    """Show how a dataset is split across clients: sizes, label counts, and a label-distribution plot."""
    from fedhet.engine.simulation import build_federation
    from fedhet.paths import check_output_file
    from fedhet.results.plots import plot_label_distribution

    check_output_file(plot, "--plot")
    given = {"dataset": dataset, "partition": partition, "clients": clients, "seed": seed, "data_dir": data_dir}
    check_shortcut_conflicts(set_ or (), given)
    with interrupted(BUILDING_CONFIG):
        cfg = api.make_config(config, set_, plugins=plugin or (), **given)
    with interrupted("while the clients' data was being split; run the command again"):
        fed = build_federation(cfg)
    counts = fed.train_counts
    table = Table(title=f"{cfg.dataset.name} / {cfg.partition.name} {cfg.partition.params() or ''}")
    table.add_column("client", justify="right")
    table.add_column("size", justify="right")
    table.add_column("classes", justify="right")
    for c in range(fed.num_classes):
        table.add_column(str(c), justify="right")
    for i, row in enumerate(counts):
        table.add_row(str(i), str(int(row.sum())), str(int((row > 0).sum())), *[str(int(v)) for v in row])
    console.print(table)
    sizes = counts.sum(1)
    console.print(
        f"clients={len(sizes)} samples={int(sizes.sum())} size min/median/max="
        f"{int(sizes.min())}/{int(sorted(sizes)[len(sizes) // 2])}/{int(sizes.max())} "
        f"global test set: {len(fed.y_test)} ({fed.test_source})"
    )
    path = plot_label_distribution(counts, plot, title=f"{cfg.dataset.name}: {cfg.partition.name} label split")
    console.print(f"plot: {path}")


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
) -> None:
    """Summarise finished (or running) runs: a mean ± std table over seeds and accuracy-vs-round curves."""
    from fedhet.engine.display import print_warning
    from fedhet.paths import check_folder, check_output_file
    from fedhet.results.html import write_html
    from fedhet.results.plots import PANELS, X_LABELS, plot_curves
    from fedhet.results.report import group_runs, load_runs, partition_note, print_table, summary_table, to_markdown

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
    groups = group_runs(loaded)
    rows = summary_table(groups, metric=metric)
    note = partition_note(groups)
    print_table(rows, console)
    if note:
        console.print(note)
    if markdown:
        markdown.write_text(to_markdown(rows) + (f"\n{note}\n" if note else "") + "\n")
        console.print(f"markdown: {markdown}")
    if plot:
        console.print(f"plot: {plot_curves(groups, plot, metric=metric, smooth=smooth, panels=panels, x=x)}")
    if html:
        console.print(f"html: {write_html(groups, html, metrics=(metric,), smooth=smooth, panels=panels, x=x)}")


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
    ``fedhet list config`` lists every config key."""
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
        for e in registry.entries():
            params = ""
            if e.params is not None:
                fields = e.params.model_fields.items()
                params = ", ".join(
                    f"{k} (required)" if f.is_required() else f"{k}={f.get_default(call_default_factory=True)!r}"
                    for k, f in fields
                )
            cells = (e.name, e.summary, params, *([_fit_text(kind, e.name)] if extra else []))
            table.add_row(*map(escape, cells))  # as written: "fedhet[hf]" is not a style tag
        console.print(table)


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


def main() -> None:
    try:
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
