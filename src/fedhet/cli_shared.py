"""What every ``fedhet`` command shares: the consoles, the options that build a config, and the final messages.

``fedhet.cli`` and ``fedhet.flower.cli`` both import from here (and neither from the other's commands), so every
command that runs a config takes the same shortcuts: ``-c -s -a -d -p -m -n -r -o --name --seed --server --data-dir
--plugin``.
"""

from __future__ import annotations

import inspect
import logging
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.console import Console
from rich.markup import escape

from fedhet.errors import Interrupted

# click 8.4+ ends "No such command 'rn'." with "Did you mean 'run'?" itself, and typer (0.16+) appends its own on top:
# the apps turn typer's off where click has its own, so the suggestion is printed once with any pair of versions
SUGGEST_COMMANDS: dict[str, bool] = (
    {"suggest_commands": False}
    if hasattr(click.exceptions, "NoSuchCommand") and "suggest_commands" in inspect.signature(typer.Typer).parameters
    else {}
)

# Piped output (CI logs, `| tee`) gets a wide console so tables are not squeezed to 80 columns.
console = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)

# Path options are not checked by click (readable=False): its checks print a usage box, and miss FIFOs and device
# files; fedhet/paths.py checks each path as one error line naming the option
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", readable=False, help="TOML config file.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", "-s", help="Override, e.g. -s train.lr=0.05 (repeat).")]
PluginOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--plugin",
        help="A .py file or module that registers components from outside fedhet (repeat); recorded in run.plugins. "
        "Installed packages' fedhet.plugins entry points load without it.",
    ),
]
AlgorithmOpt = Annotated[
    str | None, typer.Option("--algorithm", "-a", help="Algorithm (algorithm.name; fedhet list algorithms).")
]
DatasetOpt = Annotated[
    str | None, typer.Option("--dataset", "-d", help="Dataset (dataset.name; fedhet list datasets), e.g. digits.")
]
PartitionOpt = Annotated[
    str | None, typer.Option("--partition", "-p", help="Partitioner (partition.name; fedhet list partitioners).")
]
ModelOpt = Annotated[
    str | None, typer.Option("--model", "-m", help="Model (model.name; fedhet list models), e.g. mlp, cnn, lenet5.")
]
ServerOpt = Annotated[
    str | None, typer.Option("--server", help="Server optimiser (server.name: sgd, fedavgm, fedadam...).")
]
RoundsOpt = Annotated[int | None, typer.Option("--rounds", "-r", help="Rounds to train (run.rounds).")]
ClientsOpt = Annotated[int | None, typer.Option("--clients", "-n", help="Number of clients (partition.num_clients).")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Seed of the run (run.seed).")]
OutOpt = Annotated[str | None, typer.Option("--out", "-o", help="Parent folder of run folders (run.out_dir).")]
NameOpt = Annotated[str | None, typer.Option("--name", help="The run's folder name (run.name).")]
DataDirOpt = Annotated[
    str | None,
    typer.Option(
        "--data-dir",
        help="Folder that holds (or receives) the dataset's files (dataset.data_dir); default $FEDHET_DATA, else the "
        "system data folder. Searched alone when given.",
    ),
]
ThreadsOpt = Annotated[
    int | None,
    typer.Option("--threads", min=1, help="Torch threads to train with (default: torch's own, one per usable core)."),
]
AcceptPluginsOpt = Annotated[
    bool,
    typer.Option(
        "--accept-changed-plugins",
        help="Continue (or skip as finished) runs whose plug-in files changed since they ran; refused by default.",
    ),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", help="Show the libraries' own logs and warnings (Flower, Ray).")]

# The config shortcuts of every command that runs a config (run, compare, flower simulate, flower app)
SHORTCUTS = (
    "algorithm",
    "dataset",
    "partition",
    "model",
    "server",
    "rounds",
    "clients",
    "seed",
    "out",
    "name",
    "data_dir",
)


def shortcuts(values: dict[str, Any], unchecked: tuple[str, ...] = ()) -> dict[str, Any]:
    """The shortcut options among a command's arguments (its ``locals()``), as ``api.make_config`` takes them;
    refuses a shortcut and an ``-s`` of the same setting with different values (``-n 6 -s partition.num_clients=4``),
    except for the shortcuts in ``unchecked`` (compare's ``--name`` is the comparison's folder, not run.name)."""
    given = {key: values.get(key) for key in SHORTCUTS}
    check_shortcut_conflicts(values.get("set_") or (), {k: v for k, v in given.items() if k not in unchecked})
    return given


# shortcut -> how the command line spells it, for messages
SHORTCUT_FLAGS = {
    "algorithm": "-a",
    "dataset": "-d",
    "partition": "-p",
    "model": "-m",
    "server": "--server",
    "rounds": "-r",
    "clients": "-n",
    "seed": "--seed",
    "out": "-o",
    "name": "--name",
    "data_dir": "--data-dir",
}


def check_shortcut_conflicts(sets: list[str] | tuple[str, ...], given: dict[str, Any]) -> None:
    """One error for a shortcut flag and an ``-s`` override that set the same key to different values: ``-s
    partition.num_clients=4 -n 6`` would otherwise train 4 clients without a word. Equal values are fine."""
    from fedhet.api import SHORTCUTS as KEYS
    from fedhet.config import parse_value
    from fedhet.errors import ConfigError

    overrides: dict[str, Any] = {}
    for item in sets:
        if "=" in item:  # a malformed one is worded by make_config
            key, value = item.split("=", 1)
            overrides[".".join(p.strip() for p in key.strip().split("."))] = parse_value(value)
    clashes = []
    for short, value in given.items():
        key = KEYS[short]
        if value is None or key not in overrides:
            continue
        other = overrides[key]
        # a value of another type (-s run.rounds=true) is not a rival setting but a wrong one: validation words it
        if type(other) is type(value) and other != value:
            clashes.append(f"{SHORTCUT_FLAGS[short]} {value} and -s {key}={other}")
    if clashes:
        raise ConfigError(
            f"conflicting settings: {'; '.join(clashes)} set the same key to different values; give one of them"
        )


def set_threads(threads: int | None) -> None:
    """``--threads``: torch's intra-op threads for this process; provenance.json records the count a run trains with
    (float sums differ in the last bits with it, so a resume warns when it changes)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


# Ctrl-C before a run starts: building the config loads plug-ins and checks datasets and folders (seconds)
BUILDING_CONFIG = "while the config was being built, before anything trained; run the command again"


def usage_error_line(err: click.ClickException) -> str:
    """A click error (an unknown option or command, a value of the wrong type) as fedhet's one ``error:`` line: click's
    message, each sentence once (typer's own "Did you mean" is off where click has one, SUGGEST_COMMANDS; this keeps
    a repeated sentence from showing twice whatever version adds it), then where the valid choices are listed."""
    sentences = re.split(r"(?<=[.?!])\s+", " ".join(err.format_message().split()))
    text = " ".join(dict.fromkeys(sentences))
    ctx = getattr(err, "ctx", None)
    where = f" Try '{ctx.command_path} --help' for help." if ctx is not None else ""
    return f"[red]error:[/] {escape(text[:1].lower() + text[1:] + where)}"


@contextmanager
def interrupted(how_to_continue: str) -> Iterator[None]:
    """Ctrl-C while training: exit 130 with a message (typer would turn KeyboardInterrupt into a silent exit)."""
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(how_to_continue) from None


# Ctrl-C where no command says more (fedhet list, report, a run's last lines): what every command may say
ANY_COMMAND = "before the command finished; run it again"


class Commands(typer.core.TyperGroup):
    """The ``fedhet`` app's commands: a Ctrl-C that no ``interrupted`` block of a command names is still the one
    ``interrupted:`` line (typer turns a KeyboardInterrupt into a silent exit 130)."""

    def invoke(self, ctx: click.Context) -> Any:
        with interrupted(ANY_COMMAND):
            return super().invoke(ctx)


def print_final(summary: dict[str, Any], run_dir: Path) -> None:
    final = summary.get("final", {})
    parts = [
        f"{k}={100 * final[k]:.2f}%"
        for k in ("test_acc", "test_acc_ema", "client_dist_acc", "client_acc_worst10")
        if final.get(k) is not None
    ]
    console.print(f"[green]done[/] {escape(summary['name'])}: round {summary['rounds_done']}, " + ", ".join(parts))
    console.print(escape(f"run folder: {run_dir}"))


# Loggers of the libraries a Flower run drives; their INFO/WARNING chatter (deprecation notices, actor shutdown
# notes) is theirs, not the run's.
LIBRARY_LOGGERS = ("flwr", "ray")


@contextmanager
def quiet_libraries(verbose: bool = False) -> Iterator[None]:
    """Keep Flower's and Ray's warnings and banners off the console (errors still show) unless ``verbose``."""
    if verbose:
        yield
        return
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [log.level for log in loggers]
    with warnings.catch_warnings():
        for module in (r"ray(\..*)?$", r"flwr(\..*)?$"):
            warnings.filterwarnings("ignore", category=FutureWarning, module=module)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
        for log in loggers:
            log.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for log, level in zip(loggers, levels, strict=True):
                log.setLevel(level)
