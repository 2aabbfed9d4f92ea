"""``fedhet cache list | clean``: the prepared arrays of Hugging Face datasets (``<cache>/fedhet-prepared/``), listed
with what each was prepared from, and removed by age, by staleness or all. Only fedhet's own files in that folder
(``<key>.npz``, and the temporary files of killed writes) are ever listed or removed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.markup import escape
from rich.table import Table

from fedhet.cli_shared import SUGGEST_COMMANDS, console
from fedhet.errors import ConfigError

cache_app = typer.Typer(
    no_args_is_help=True,
    help="The prepared arrays of Hugging Face datasets (dataset 'hf'): list them, remove old ones.",
    **SUGGEST_COMMANDS,
)

CacheDirOpt = Annotated[
    str | None,
    typer.Option(
        "--data-dir",
        help="The runs' dataset.data_dir: its huggingface/fedhet-prepared/ is listed; default $FEDHET_DATA, else "
        "Hugging Face's own cache (HF_HOME, HF_DATASETS_CACHE).",
    ),
]


def _folder(data_dir: str | None) -> Path:
    from fedhet.data.datasets.huggingface import prepared_dir

    return prepared_dir(data_dir)


def _when(entry: dict[str, Any], now: float) -> str:
    from fedhet.data.datasets.prepared import days_unused

    days = days_unused(entry, now)
    ago = "today" if days < 1 else f"{int(days)} day{'s' if int(days) != 1 else ''} ago"
    return f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(entry['used']))} ({ago})"


@cache_app.command("list")
def list_cmd(data_dir: CacheDirOpt = None) -> None:
    """Each prepared file: the dataset, its settings (those not at their default), size and when it was last used."""
    from fedhet.data.datasets.prepared import describe, entries
    from fedhet.paths import size_text

    folder = _folder(data_dir)
    found = entries(folder)
    if not found:
        console.print(f"no prepared files in {escape(str(folder))}", highlight=False)
        return
    table = Table(title=f"prepared files in {folder}", title_justify="left")
    for column in ("file", "dataset", "settings", "size", "last used"):
        table.add_column(column, justify="right" if column == "size" else "left")
    now = time.time()
    for entry in found:
        source, settings = describe(entry)
        row = (entry["path"].name, source, settings, size_text(entry["size"]), _when(entry, now))
        table.add_row(*(escape(text) for text in row))
    console.print(table)
    console.print(f"{len(found)} file(s), {size_text(sum(e['size'] for e in found))}", highlight=False)


@cache_app.command("clean")
def clean_cmd(
    all_: Annotated[bool, typer.Option("--all", help="Remove every prepared file.")] = False,
    unused_days: Annotated[
        float | None, typer.Option("--unused-days", min=0, help="Remove the files not used for this many days.")
    ] = None,
    stale: Annotated[
        bool,
        typer.Option(
            "--stale",
            help="Remove the files no current dataset can use: damaged ones, an older fedhet's, a local copy's that "
            "is gone or whose files changed, killed writes' leftovers (a hub dataset's are kept).",
        ),
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Remove without asking.")] = False,
    data_dir: CacheDirOpt = None,
) -> None:
    """Remove prepared files: all, or those matching every filter given; a run that needs one prepares it again."""
    from fedhet.data.datasets.prepared import days_unused, describe, entries
    from fedhet.paths import size_text

    if all_ == (unused_days is not None or stale):
        raise ConfigError(
            "fedhet cache clean: say which files to remove: --all, or --unused-days N and/or --stale (files that "
            "match both when both are given); fedhet cache list shows them"
        )
    folder = _folder(data_dir)
    now = time.time()
    hashes: dict[str, str | None] = {}
    chosen = [
        e
        for e in entries(folder)
        if all_ or ((unused_days is None or days_unused(e, now) >= unused_days) and (not stale or _stale(e, hashes)))
    ]
    if not chosen:
        console.print(f"nothing to remove in {escape(str(folder))}", highlight=False)
        return
    total = sum(e["size"] for e in chosen)
    if not yes:
        for entry in chosen:
            console.print(f"  {entry['path'].name}  {escape(describe(entry)[0])}  {size_text(entry['size'])}")
        try:
            sure = typer.confirm(f"remove these {len(chosen)} file(s) from {folder} ({size_text(total)})?")
        except click.Abort:  # no answer (stdin closed): nothing is removed
            console.print()
            sure = False
        if not sure:
            console.print("nothing removed", highlight=False)
            raise typer.Exit(1)
    _remove(chosen)


def _stale(entry: dict[str, Any], hashes: dict[str, str | None]) -> bool:
    from fedhet.data.datasets.prepared import stale

    def content_hash(source: str) -> str | None:
        if source not in hashes:
            hashes[source] = _content_hash(Path(source))
        return hashes[source]

    return stale(entry, content_hash)


def _content_hash(path: Path) -> str | None:
    """The hash a run of the local copy at ``path`` would key its prepared file with now; None when it is gone."""
    from fedhet.data.datasets.huggingface import local_manifest

    if not path.exists():
        return None
    try:
        return local_manifest(path).fields()["content_hash"]
    except (OSError, ValueError):
        return None


def _remove(chosen: list[dict[str, Any]]) -> None:
    from fedhet.data.datasets.prepared import describe
    from fedhet.paths import size_text

    freed = removed = 0
    for entry in chosen:
        path = entry["path"]
        try:
            path.unlink()
        except FileNotFoundError:
            continue  # removed meanwhile
        except OSError as err:
            console.print(f"[yellow]warning:[/] cannot remove {escape(str(path))}: {escape(err.strerror or str(err))}")
            continue
        freed, removed = freed + entry["size"], removed + 1
        console.print(f"removed {escape(path.name)} ({escape(describe(entry)[0])}, {size_text(entry['size'])})")
    console.print(f"freed {size_text(freed)} ({removed} file(s))", highlight=False)
