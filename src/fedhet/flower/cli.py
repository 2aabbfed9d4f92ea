"""``fedhet flower ...``: Flower app folders for ``flwr run``, Flower's Ray simulation, client data files."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Any

import typer

from fedhet.cli_shared import (
    BUILDING_CONFIG,
    SUGGEST_COMMANDS,
    AlgorithmOpt,
    ClientsOpt,
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
    VerboseOpt,
    console,
    interrupted,
    print_final,
    quiet_libraries,
    shortcuts,
)
from fedhet.errors import ConfigError

flower_app = typer.Typer(
    no_args_is_help=True,
    help="Run fedhet algorithms on Flower: app folders for `flwr run` (SuperLink + SuperNodes), Flower's Ray "
    "simulation, and per-client data files for SuperNodes.",
    **SUGGEST_COMMANDS,
)


def _need_flower(command: str) -> None:
    """`flower app` and `flower simulate` load Flower; without the flower extra, one line saying how to get it."""
    if importlib.util.find_spec("flwr") is None:
        raise ConfigError(f"fedhet flower {command} needs Flower (flwr), not installed: pip install 'fedhet[flower]'")


def _config(config: Path | None, sets: list[str] | None, plugins: list[str] | None, runs_here: bool = True, **kw: Any):
    from fedhet.api import make_config

    with interrupted(BUILDING_CONFIG):
        return make_config(config, sets, plugins=plugins or (), runs_here=runs_here, **kw)


@flower_app.command("app")
def app_cmd(
    app_dir: Annotated[Path, typer.Argument(readable=False, help="App folder to write (its name is the app's name).")],
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
    out: Annotated[
        str | None, typer.Option("--out", "-o", help="Parent folder of run folders on the SuperLink (run.out_dir).")
    ] = None,
    name: NameOpt = None,
    data_dir: DataDirOpt = None,
    plugin: Annotated[
        list[str] | None,
        typer.Option("--plugin", help="A plug-in .py file (copied into the app folder) or module (repeat)."),
    ] = None,
    app_name: Annotated[str | None, typer.Option("--app-name", help="Flower app name (default: the folder's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the app files of a non-empty folder.")] = False,
) -> None:
    """Write a Flower app folder (pyproject.toml, fedhet.toml, fedhet_app.py) to start with `flwr run`."""
    _need_flower("app")
    from fedhet.flower.bundle import write_app
    from fedhet.paths import check_folder

    check_folder(app_dir, "app folder (APP_DIR)", creatable=True)
    # the app runs on the SuperLink's machines: its run.device is checked there, not here
    cfg = _config(
        config,
        set_,
        plugin,
        runs_here=False,
        **shortcuts(locals()),
    )
    folder = write_app(cfg, app_dir, name=app_name, force=force)
    console.print(f"[green]Flower app[/] written to {folder}")
    console.print("run it on a SuperLink:  flwr run " + f"{folder} <superlink-connection> --stream")
    console.print("see docs/deploy.md for the SuperLink, SuperNode, TLS and authentication steps")


@flower_app.command("simulate")
def simulate_cmd(
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
    client_cpus: Annotated[float, typer.Option("--client-cpus", help="CPUs of one ClientApp worker.")] = 1.0,
    client_gpus: Annotated[float, typer.Option("--client-gpus", help="GPUs of one worker (fractions share).")] = 0.0,
    num_cpus: Annotated[int | None, typer.Option("--num-cpus", help="CPUs Ray may use here (default: all).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run's last checkpoint.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing run folder.")] = False,
    node_state_dir: Annotated[
        Path | None,
        typer.Option(
            "--node-state-dir",
            readable=False,
            help="Folder under which each virtual node keeps its clients' state across Flower runs, so --resume "
            "continues it (default: node_state in the run folder).",
        ),
    ] = None,
    no_node_state: Annotated[
        bool,
        typer.Option(
            "--no-node-state", help="Keep client state only in Flower's Context.state (a resume cannot continue it)."
        ),
    ] = False,
    accept_state_loss: Annotated[
        bool,
        typer.Option(
            "--accept-state-loss",
            help="Continue a run even where client-held state was lost (noted in notices.jsonl); otherwise it stops.",
        ),
    ] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run a config in Flower's Ray simulation (one virtual SuperNode per client); writes the usual run folder."""
    _need_flower("simulate")
    from fedhet.api import run_dir_of
    from fedhet.engine.rundir import check_run_flags
    from fedhet.flower.app import RunOptions
    from fedhet.flower.raysim import run_ray_simulation
    from fedhet.naming import check_config_paths
    from fedhet.paths import check_folder

    check_run_flags(resume, overwrite)
    if node_state_dir is not None:
        node_state_dir = check_folder(node_state_dir.expanduser(), "--node-state-dir", creatable=True)
    cfg = _config(
        config,
        set_,
        plugin,
        **shortcuts(locals()),
    )
    check_config_paths(cfg, writable=True)  # the output folders can be made and written, before Ray starts
    options = RunOptions(resume=resume, overwrite=overwrite, accept_state_loss=accept_state_loss)
    run_dir = run_dir_of(cfg)
    with interrupted(f"the last checkpoint is kept; continue with --resume ({run_dir})"), quiet_libraries(verbose):
        summary = run_ray_simulation(
            cfg,
            options,
            client_cpus,
            client_gpus,
            num_cpus,
            verbose,
            node_state_dir=node_state_dir,
            node_state=not no_node_state,
        )
    print_final(summary, run_dir)


@flower_app.command("export")
def export_cmd(
    out_folder: Annotated[
        Path, typer.Option("--out", "-o", readable=False, help="Folder for the client_<id>.npz files.")
    ],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    dataset: DatasetOpt = None,
    partition: PartitionOpt = None,
    clients: ClientsOpt = None,
    seed: SeedOpt = None,
    data_dir: DataDirOpt = None,
    plugin: PluginOpt = None,
) -> None:
    """Write every client's data as client_<id>.npz, for SuperNodes started with --node-config data-path=..."""
    from fedhet.flower.data import export_clients
    from fedhet.paths import check_folder

    check_folder(out_folder, "--out", creatable=True)
    cfg = _config(
        config, set_, plugin, dataset=dataset, partition=partition, clients=clients, seed=seed, data_dir=data_dir
    )
    paths = export_clients(cfg, out_folder)
    console.print(f"wrote {len(paths)} client files to {out_folder} ({paths[0].name} ... {paths[-1].name})")
