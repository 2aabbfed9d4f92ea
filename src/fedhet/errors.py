"""User-facing errors: each carries a one-line message that names the problem and, where useful, the valid choices."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FedhetError(Exception):
    """Base class of errors that the CLI prints as one line instead of a traceback."""


class ConfigError(FedhetError, ValueError):
    """A configuration value, key or name is wrong."""


class RunFailed(FedhetError):
    """A run that cannot go on (non-finite model, no client left); summary.json says why, the last checkpoint stays."""


class CorruptFile(FedhetError, ValueError):
    """A run-folder file (JSON document, metrics log) that cannot be read or parsed; the message names it."""


class DiskFull(RunFailed):
    """A file of the run could not be written (no space, quota): the run stops at its last checkpoint, which stays
    complete; the message names the file, the last checkpointed round and that ``fedhet resume`` continues."""


class Interrupted(FedhetError):
    """Ctrl-C: training stopped, the last checkpoints are kept; the message says how to continue."""


class FedhetWarning(UserWarning):
    """A warning in fedhet's words (a library's warning reworded, naming fedhet's settings): the CLI prints it as one
    ``warning:`` line, without the source line Python adds."""


def suggestion(name: str, choices: Iterable[str], prefix: str = "") -> str:
    """``"; did you mean 'fedprox'?"`` for the valid name closest to a mistyped ``name`` (difflib's ratio, case
    ignored; ``prefix`` is put before the name shown, e.g. ``train.``), or "" when none is close. Every "unknown X"
    message (components, config keys and sections, ``fedhet list`` kinds) ends with it."""
    lowered = {str(c).lower(): str(c) for c in choices}
    close = difflib.get_close_matches(str(name).lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean {prefix + lowered[close[0]]!r}?" if close else ""


def unknown_choice(kind: str, name: str, choices: Iterable[str], note: str = "") -> ConfigError:
    """The standard 'unknown X' error: the valid names, ``note`` (a hint in brackets), then the closest names."""
    choices = sorted(choices)
    return ConfigError(f"unknown {kind} {name!r}; choose one of: {', '.join(choices)}{note}{suggestion(name, choices)}")
