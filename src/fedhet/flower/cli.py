"""``fedhet flower ...``: Flower app folders for ``flwr run``, Flower's Ray simulation, client data files."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

flower_app = typer.Typer(
    no_args_is_help=True,
    help="Run fedhet algorithms on Flower: app folders for `flwr run` (SuperLink + SuperNodes), Flower's Ray "
    "simulation, and per-client data files for SuperNodes.",
)
console = Console(width=None if sys.stdout.isatty() else 160)

ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="fedhet TOML config file.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override, e.g. -s train.lr=0.05 (repeat).")]


def _config(config: Path | None, sets: list[str] | None, runs_here: bool = True):
    from fedhet.config import load_config

    return load_config(config, list(sets or []), runs_here=runs_here)


@flower_app.command("app")
def app_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="App folder to write (its name is the app's name).")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    name: Annotated[str | None, typer.Option("--name", help="Flower app name (default: the folder's name).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the app files of a non-empty folder.")] = False,
) -> None:
    """Write a Flower app folder (pyproject.toml, fedhet.toml, fedhet_app.py) to start with `flwr run`."""
    from fedhet.flower.bundle import write_app

    # the app runs on the SuperLink's machines: its run.device is checked there, not here
    folder = write_app(_config(config, set_, runs_here=False), out, name=name, force=force)
    console.print(f"[green]Flower app[/] written to {folder}")
    console.print("run it on a SuperLink:  flwr run " + f"{folder} <superlink-connection> --stream")
    console.print("see docs/deploy.md for the SuperLink, SuperNode, TLS and authentication steps")


@flower_app.command("simulate")
def simulate_cmd(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    client_cpus: Annotated[float, typer.Option("--client-cpus", help="CPUs of one ClientApp worker.")] = 1.0,
    client_gpus: Annotated[float, typer.Option("--client-gpus", help="GPUs of one worker (fractions share).")] = 0.0,
    num_cpus: Annotated[int | None, typer.Option("--num-cpus", help="CPUs Ray may use here (default: all).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run's last checkpoint.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing run folder.")] = False,
    node_state_dir: Annotated[
        Path | None,
        typer.Option(
            "--node-state-dir",
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
    verbose: Annotated[bool, typer.Option("--verbose", help="Flower's debug logs.")] = False,
) -> None:
    """Run a config in Flower's Ray simulation (one virtual SuperNode per client); writes the usual run folder."""
    from fedhet.cli import _print_final
    from fedhet.flower.app import RunOptions
    from fedhet.flower.raysim import run_ray_simulation

    cfg = _config(config, set_)
    options = RunOptions(resume=resume, overwrite=overwrite, accept_state_loss=accept_state_loss)
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
    _print_final(summary, Path(cfg.run.out_dir) / summary["name"])


@flower_app.command("export")
def export_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the client_<id>.npz files.")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Write every client's data as client_<id>.npz, for SuperNodes started with --node-config data-path=..."""
    from fedhet.flower.data import export_clients

    paths = export_clients(_config(config, set_), out)
    console.print(f"wrote {len(paths)} client files to {out} ({paths[0].name} ... {paths[-1].name})")
