"""What a run shows while it trains: a progress bar on a terminal or in a notebook, one line per evaluation where
the output goes to a file or a pipe (a bar cannot redraw there), and one-line warnings."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def print_warning(console: Console, text: str) -> None:
    """A warning as one ``warning:`` line, however long (brackets in it are not markup)."""
    console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=True)


class RunDisplay:
    def __init__(self, console: Console, name: str, rounds: int, enabled: bool) -> None:
        self.console, self.name, self.rounds, self.enabled = console, name, rounds, enabled
        self.progress: Progress | None = None

    @property
    def interactive(self) -> bool:
        """The console redraws a progress bar: a terminal or a notebook."""
        return self.console.is_terminal or self.console.is_jupyter

    def warn(self, text: str) -> None:
        print_warning(self.console, text)

    def note(self, text: str) -> None:
        """A fact worth a line that is no warning (where the initial model came from)."""
        self.console.print(f"[cyan]note:[/] {escape(text)}", highlight=False, soft_wrap=True)

    def dropped(self, rnd: int, phase: str, failures: list[dict[str, Any]], clients: int) -> None:
        first = failures[0]
        why = first["error"] if len(first["error"]) <= 160 else first["error"][:157] + "..."
        self.warn(
            f"round {rnd}{'' if phase == 'train' else f' ({phase})'}: dropped {len(failures)} of {clients} "
            f"clients (client {first['client']}: {why}); see failures.jsonl"
        )

    def __enter__(self) -> RunDisplay:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("acc {task.fields[acc]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not (self.enabled and self.interactive),  # else evaluated() prints lines
            transient=False,
        )
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def start(self, done: int) -> None:
        self.task = self.progress.add_task(self.name, total=self.rounds, completed=done, acc="—")

    def evaluated(self, record: dict[str, Any]) -> None:
        spent = privacy_spent(record)
        self.progress.update(self.task, acc=f"{100 * record['test_acc']:.2f}%{spent}")
        if not self.enabled or self.interactive:
            return
        loss = record.get("train_loss")
        text = f"{self.name}: round {record['round']}/{self.rounds}, test_acc {100 * record['test_acc']:.2f}%"
        text += f", train_loss {loss:.4g}" if loss is not None else ""
        text += spent
        text += f", {record['clients']} clients, {record['elapsed_s']:.1f} s"
        self.console.print(escape(text), highlight=False, soft_wrap=True)

    def advance(self) -> None:
        self.progress.update(self.task, advance=1)


def privacy_spent(record: dict[str, Any]) -> str:
    """ ", epsilon 3.21" for a run under differential privacy (central: the run's; local: the largest of a client's),
    else ""."""
    if record.get("privacy/epsilon") is not None:
        return f", epsilon {record['privacy/epsilon']:.3g}"
    if record.get("privacy/epsilon_max") is not None:
        return f", epsilon {record['privacy/epsilon_max']:.3g} (largest of a client)"
    return ""
