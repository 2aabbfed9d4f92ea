"""A Flower ServerApp and ClientApp for any fedhet config.

``make_server_app`` / ``make_client_app`` take a function that returns the run's fedhet ``Config`` for a Flower
``Context``. Two sources use them:

* an app folder written by ``fedhet flower app`` (for ``flwr run``): its ``fedhet_app.py`` calls
  ``folder_server_app`` / ``folder_client_app``, and the config is the folder's ``fedhet.toml`` plus the run
  config's ``overrides``;
* ``fedhet.flower.raysim.run_ray_simulation``: the config object itself, for Flower's Ray simulation.

Run options come from Flower's run config (``[tool.flwr.app.config]`` of the app, overridable with
``flwr run --run-config``): see ``RUN_CONFIG``.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from rich.console import Console

from fedhet.config import Config, load_config
from fedhet.flower.client import make_client_app
from fedhet.flower.server import Exchange, FlowerExecutor, discover, server_federation

# Flower run config keys of a fedhet app, with their defaults (Flower only accepts overrides of declared keys).
RUN_CONFIG: dict[str, Any] = {
    "config": "fedhet.toml",  # the fedhet config, relative to the app folder (or absolute)
    "overrides": "",  # fedhet overrides, e.g. "train.lr=0.05 run.rounds=50 run.out_dir='/srv/runs'"
    "resume": False,  # continue the run folder's last checkpoint (client state: nodes' state-dir, see deploy.md)
    "overwrite": False,  # replace an existing run folder
    "accept-state-loss": False,  # go on when client-held state is lost (no node state folder), with a notice
    "round-timeout": 0.0,  # seconds a phase waits for replies before dropping the missing clients; 0: no limit
    "node-wait": 600.0,  # seconds to wait until every client is held by a connected SuperNode
}


@dataclass(frozen=True)
class RunOptions:
    resume: bool = False
    overwrite: bool = False
    round_timeout: float = 0.0
    node_wait: float = 600.0
    accept_state_loss: bool = False

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunOptions:
        rc = {**RUN_CONFIG, **run_config}
        return cls(
            resume=bool(rc["resume"]),
            overwrite=bool(rc["overwrite"]),
            round_timeout=float(rc["round-timeout"]),
            node_wait=float(rc["node-wait"]),
            accept_state_loss=bool(rc["accept-state-loss"]),
        )


def run_server(grid: Grid, cfg: Config, options: RunOptions, console: Console | None = None) -> dict[str, Any]:
    """Find the nodes, then run the engine's round loop over them; returns the run's summary."""
    from fedhet.engine.simulation import Simulation, resolve_config

    resolve_config(cfg)  # a wrong name or value fails here, before waiting for any node
    nodes = discover(grid, cfg.partition.num_clients, options.node_wait)
    name = cfg.run.name or cfg.default_name()
    executor = FlowerExecutor(
        grid,
        nodes,
        Exchange(grid, timeout=options.round_timeout or None),
        cfg.run.device,
        run_name=name,
        notices=Path(cfg.run.out_dir) / name / "notices.jsonl",
        accept_state_loss=options.accept_state_loss,
    )
    sim = Simulation(cfg, fed=server_federation(cfg, nodes), console=console, executor=executor)
    return sim.run(resume=options.resume, overwrite=options.overwrite)


def make_server_app(
    load_config: Callable[[Context], Config],
    load_options: Callable[[dict[str, Any]], RunOptions] = RunOptions.from_run_config,
) -> ServerApp:
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        run_server(grid, load_config(context), load_options(dict(context.run_config)))

    return app


def folder_config_loader(app_dir: Path) -> Callable[[Context], Config]:
    """The config of an app folder: its fedhet.toml (or the run config's ``config``) plus ``overrides``."""

    def load(context: Context) -> Config:
        rc = {**RUN_CONFIG, **context.run_config}
        path = Path(str(rc["config"])).expanduser()
        return load_config(path if path.is_absolute() else app_dir / path, shlex.split(str(rc["overrides"])))

    return load


def folder_server_app(app_dir: str | Path) -> ServerApp:
    """The ServerApp of an app folder written by ``fedhet flower app``."""
    return make_server_app(folder_config_loader(Path(app_dir)))


def folder_client_app(app_dir: str | Path) -> ClientApp:
    """The ClientApp of an app folder written by ``fedhet flower app``."""
    return make_client_app(folder_config_loader(Path(app_dir)))
