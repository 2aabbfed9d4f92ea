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
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import ERROR
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from rich.console import Console

from fedhet.config import Config, load_config
from fedhet.errors import ConfigError, FedhetError
from fedhet.flower.client import make_client_app
from fedhet.flower.secagg import SECAGG, SecAggSettings, SecureAggregation, algorithm_refusal, refusal
from fedhet.flower.server import Exchange, FlowerExecutor, Nodes, discover, server_federation
from fedhet.naming import run_name

# Flower run config keys of a fedhet app, with their defaults (Flower only accepts overrides of declared keys).
RUN_CONFIG: dict[str, Any] = {
    "config": "fedhet.toml",  # the fedhet config, relative to the app folder (or absolute)
    "overrides": "",  # fedhet overrides, e.g. "train.lr=0.05 run.rounds=50 run.out_dir='/srv/runs'"
    "resume": False,  # continue the run folder's last checkpoint (client state: nodes' state-dir, see deploy.md)
    "overwrite": False,  # replace an existing run folder
    "accept-state-loss": False,  # go on when client-held state is lost (no node state folder), with a notice
    "round-timeout": 0.0,  # seconds a phase waits for replies before dropping the missing clients; 0: no limit
    "node-wait": 600.0,  # seconds to wait until every client is held by a connected SuperNode
    # "secaggplus": the server learns only the weighted sum of the client models (fedhet.flower.secagg); its
    # parameters are those of Flower's SecAggPlusWorkflow (a count above 1, else a fraction)
    "secure-aggregation": "",
    "secagg-num-shares": 1.0,
    "secagg-reconstruction-threshold": 0.5,
    "secagg-clipping-range": 8.0,
    "secagg-quantization-range": 2**22,
}


@dataclass(frozen=True)
class RunOptions:
    resume: bool = False
    overwrite: bool = False
    round_timeout: float = 0.0
    node_wait: float = 600.0
    accept_state_loss: bool = False
    secure_aggregation: SecAggSettings | None = None  # SecAgg+ over the nodes (fedhet.flower.secagg)
    # how messages tell the user to continue or replace a run folder: fedhet's flags, or Flower's run config
    flags: tuple[str, str] = ("--resume", "--overwrite")
    # set by a caller that ends the run early (Ctrl-C in fedhet flower simulate): the ServerApp stops at its next
    # wait on the nodes, so its thread does not outlive the command
    stop: threading.Event | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunOptions:
        rc = {**RUN_CONFIG, **run_config}
        return cls(
            resume=bool(rc["resume"]),
            overwrite=bool(rc["overwrite"]),
            round_timeout=float(rc["round-timeout"]),
            node_wait=float(rc["node-wait"]),
            accept_state_loss=bool(rc["accept-state-loss"]),
            secure_aggregation=secure_settings(rc),
            flags=("--run-config 'resume=true'", "--run-config 'overwrite=true'"),
        )


def secure_settings(rc: dict[str, Any]) -> SecAggSettings | None:
    """The run config's SecAgg+ settings; None without secure aggregation."""
    kind = str(rc["secure-aggregation"]).strip().lower()
    if kind in ("", "none"):
        return None
    if kind != SECAGG:
        raise ConfigError(f"secure-aggregation={kind!r}: choose {SECAGG!r} or leave it empty")
    return SecAggSettings(
        num_shares=float(rc["secagg-num-shares"]),
        threshold=float(rc["secagg-reconstruction-threshold"]),
        clipping_range=float(rc["secagg-clipping-range"]),
        quantization_range=int(rc["secagg-quantization-range"]),
    )


def secure_aggregation(cfg: Config, options: RunOptions, nodes: Nodes, fed) -> SecureAggregation | None:
    """SecAgg+ for this run, or None; refuses a run whose server needs more than the weighted sum."""
    settings = options.secure_aggregation
    if settings is None:
        return None
    why = refusal(cfg, settings)
    if why is None:
        held = list(nodes.holder.values())
        crowded = sorted({n for n in held if held.count(n) > 1})
        if crowded:
            why = f"SecAgg+'s participants are nodes: each SuperNode must hold one client (nodes {crowded} hold more)"
    if why is not None:
        raise ConfigError(f"secure-aggregation={SECAGG!r}: {why}")
    largest = int(fed.train_counts.sum(axis=1).max())  # weights n_k / largest stay within SecAgg+'s max_weight
    try:
        return SecureAggregation(settings, max(largest, 1), timeout=options.round_timeout or None)
    except (TypeError, ValueError) as err:  # Flower's own checks of the parameters
        raise ConfigError(f"secure-aggregation={SECAGG!r}: {err}") from None


def check_synchronous(cfg: Config) -> None:
    """The Flower server runs synchronous rounds: ``server.mode = "fedbuff"`` is refused in one line."""
    if cfg.server.mode != "sync":
        raise ConfigError(
            f"server.mode={cfg.server.mode!r} runs on the simulated clock of `fedhet run` and `fedhet compare`; "
            "the Flower server's rounds are synchronous (use server.mode='sync')"
        )


def run_server(grid: Grid, cfg: Config, options: RunOptions, console: Console | None = None) -> dict[str, Any]:
    """Find the nodes, then run the engine's round loop over them; returns the run's summary."""
    from fedhet.engine.simulation import Simulation, resolve_config

    resolve_config(cfg)  # a wrong name or value fails here, before waiting for any node
    check_synchronous(cfg)
    if cfg.system.active:  # simulated devices over real ones would mix two clocks and two kinds of failure
        raise ConfigError(
            f"system.profiles={cfg.system.profiles!r} simulates devices in fedhet run; a Flower deployment has real "
            "ones, whose failures go to failures.jsonl (docs/system-heterogeneity.md): use system.profiles='none'"
        )
    if options.secure_aggregation is not None:
        why = refusal(cfg, options.secure_aggregation)
        if why:  # before waiting for any node
            raise ConfigError(f"secure-aggregation={SECAGG!r}: {why}")
    nodes = discover(grid, cfg.partition.num_clients, options.node_wait, options.stop)
    fed = server_federation(cfg, nodes)
    name = run_name(cfg)
    executor = FlowerExecutor(
        grid,
        nodes,
        Exchange(grid, timeout=options.round_timeout or None, stop=options.stop),
        cfg.run.device,
        run_name=name,
        notices=Path(cfg.run.out_dir) / name / "notices.jsonl",
        accept_state_loss=options.accept_state_loss,
        secure=secure_aggregation(cfg, options, nodes, fed),
    )
    sim = Simulation(cfg, fed=fed, console=console, executor=executor)
    why = algorithm_refusal(sim.algo) if executor.secure is not None else None
    if why:
        raise ConfigError(f"secure-aggregation={SECAGG!r}: {why}")
    sim.folder.flags = dict(zip(("resume", "overwrite"), options.flags, strict=True))
    return sim.run(resume=options.resume, overwrite=options.overwrite)


class AppFailed(Exception):
    """A fedhet ServerApp that stopped on a user-facing error (already logged as one line)."""


def make_server_app(
    load_config: Callable[[Context], Config],
    load_options: Callable[[dict[str, Any]], RunOptions] = RunOptions.from_run_config,
    deployed: bool = False,
) -> ServerApp:
    """The ServerApp; ``deployed`` (under ``flwr run``) logs a fedhet error as one line instead of raising it to
    the caller (``fedhet flower simulate`` prints it itself)."""
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            run_server(grid, load_config(context), load_options(dict(context.run_config)))
        except FedhetError as err:
            if not deployed:
                raise
            # One line in the run's log, then a failure Flower records (`flwr ls` shows the run failed), raised here
            # so that its traceback is this frame only, never fedhet's internals.
            log(ERROR, "fedhet: %s", err)
            raise AppFailed(str(err)) from None

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
    return make_server_app(folder_config_loader(Path(app_dir)), deployed=True)


def folder_client_app(app_dir: str | Path) -> ClientApp:
    """The ClientApp of an app folder written by ``fedhet flower app``."""
    return make_client_app(folder_config_loader(Path(app_dir)))
